"""The instance scheduler: one token-budget mechanism; policies pick which requests get tokens.

Each step, every scheduled request's `num_computed_tokens` catches up with its `num_tokens`
within `max_num_batched_tokens` and `max_num_seqs`. There is no prefill or decode phase in the
mechanism: a prompt chunk, a whole prompt, a recompute after preemption and a decode are all the
same operation. The scheduler reads time only from its Clock and never touches the model.
"""
from __future__ import annotations

import itertools
import logging
from collections import Counter, deque

from ecoserve.clock import Clock
from ecoserve.config import CacheConfig, SchedulerConfig
from ecoserve.kv.manager import KVCacheManager
from ecoserve.request import Request, RequestStatus
from ecoserve.sched.interface import SchedulerOutput, StepResult
from ecoserve.sched.policies import make_policy
from ecoserve.sched.step import StepBuilder
from ecoserve.sched.window import PrefillWindow
from ecoserve.states import Phase

logger = logging.getLogger(__name__)
_RUNNING = RequestStatus.RUNNING


class Scheduler:
    def __init__(self, config: SchedulerConfig, cache_config: CacheConfig, num_blocks: int, clock: Clock,
                 max_model_len: int | None = None, max_loras: int | None = None) -> None:
        """`max_loras`: distinct LoRA adapters the running requests may use at once (None: LoRA off)."""
        self.config = config
        self.clock = clock
        self.max_model_len = max_model_len or config.max_model_len
        self.kv = KVCacheManager(num_blocks, cache_config.block_size, cache_config.enable_prefix_caching)
        self.policy = make_policy(config.policy)
        self.waiting: deque[Request] = deque()
        # queued, but not schedulable until their structured-output grammar is compiled (vLLM's WAITING_FOR_FSM):
        # policies never see them and they take no KV, except blocks imported for them (see kv.adopt)
        self.waiting_for_grammar: dict[str, Request] = {}
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._order: dict[str, int] = {}
        self._counter = itertools.count()
        self._finished_since_step: list[str] = []
        # ids of requests in a batch that has been scheduled but not yet updated (batches in flight): they are
        # neither scheduled again nor preempted until their result is back
        self.in_flight: set[str] = set()
        self.num_preemptions_total = 0
        self._last_step_phase: Phase = "idle"  # "prefill" if the last non-empty step computed a prompt chunk
        self.created_at = clock.now()
        self.window = PrefillWindow()  # commanded by the macro-instance scheduler (temporal policy)
        self.speculative = False  # decodes carry their requests' proposals (spec_token_ids) when set
        self.max_loras = max_loras
        self.running_loras: Counter[int] = Counter()  # adapter id -> running requests that use it (LoRA on)

    # ---- phase and window (the one definition; see sched/window.py) ------------------------
    @property
    def phase(self) -> Phase:
        """"idle" with nothing to run, else the kind of the last step: "prefill" or "decode"."""
        return self._last_step_phase if self.waiting or self.running else "idle"

    def open_window(self) -> bool:
        """The macro scheduler admits prompts to this instance from now on; False if already open."""
        return self.window.open(self.clock.now(), {r.request_id: r.num_output_tokens for r in self.running})

    def close_window(self) -> bool:
        """No new prompts from now on; the ones already queued still run. False if already closed."""
        return self.window.close(self.clock.now(), (r.request_id for r in self.waiting))

    # ---- requests in and out -------------------------------------------------------------
    def add_request(self, req: Request, wait_for_grammar: bool = False) -> None:
        """Queue a request; reject what could never run, leaving everything else untouched.

        With `wait_for_grammar` it is held out of scheduling until `grammar_ready(request_id)`."""
        self.check_request(req)
        if req.max_model_len is None:
            req.max_model_len = self.max_model_len
        self.requests[req.request_id] = req
        self._order[req.request_id] = next(self._counter)
        if wait_for_grammar:
            self.waiting_for_grammar[req.request_id] = req
        else:
            self.waiting.append(req)

    def grammar_ready(self, request_id: str) -> None:
        """A held request's grammar is compiled: it joins the waiting queue (at the back, like a new arrival)."""
        req = self.waiting_for_grammar.pop(request_id, None)
        if req is not None:
            self.waiting.append(req)

    def check_request(self, req: Request) -> None:
        """Raise ValueError if `add_request(req)` would refuse it; changes nothing."""
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        if req.num_prompt_tokens == 0:
            raise ValueError("the prompt is empty: at least one token is needed")
        if self.max_model_len is not None and req.num_prompt_tokens > self.max_model_len:
            raise ValueError(f"the prompt has {req.num_prompt_tokens} tokens, more than max_model_len "
                             f"({self.max_model_len})")
        capacity = self.kv.num_blocks * self.kv.block_size
        if req.num_prompt_tokens + 1 > capacity:
            raise ValueError(f"the prompt has {req.num_prompt_tokens} tokens but the KV cache holds only "
                             f"{capacity} tokens in all")

    def abort_requests(self, request_ids) -> list[Request]:
        aborted = []
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is not None and not req.finished:
                self.finish_request(req, RequestStatus.FINISHED_ABORTED)
                aborted.append(req)
        return aborted

    def finish_request(self, req: Request, status: RequestStatus) -> None:
        if req.finished:
            return
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
            self._lora_left(req)
        elif self.waiting_for_grammar.pop(req.request_id, None) is None:
            try:
                self.waiting.remove(req)
            except ValueError:
                pass
        req.status = status
        req.times.finished = self.clock.now()
        self.kv.free(req, keep=status is RequestStatus.FINISHED_LENGTH)
        del self.requests[req.request_id]
        self._order.pop(req.request_id, None)
        self._finished_since_step.append(req.request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- the mechanism policies use ------------------------------------------------------
    def is_schedulable(self, req: Request) -> bool:
        """Running and not in a batch in flight."""
        return req.status is _RUNNING and req.request_id not in self.in_flight

    def schedule_running(self, req: Request, step: StepBuilder, max_tokens: int | None = None) -> bool:
        """Give a running request its next tokens, preempting newer requests if KV runs out."""
        self.schedule_running_all((req,), step, max_tokens)
        return req.request_id in step.chunks

    def schedule_running_all(self, reqs, step: StepBuilder, max_tokens: int | None = None) -> None:
        """Give each running request in order its next tokens (at most `max_tokens`), preempting newer
        requests if KV runs out; skips those preempted meanwhile and stops once the step is full.

        The one path for running requests (a decode is a one-token chunk like any other). It runs
        once per request per step, so it uses locals and plain comparisons instead of min() and
        properties; a decode that fits its blocks costs one dict lookup and one add.
        """
        running, kv, in_flight = self.running, self.kv, self.in_flight
        add, caching = step.add, kv.enable_prefix_caching
        owned_blocks, block_size = kv.owned_blocks.get, kv.block_size
        preempted = step.num_preempted
        speculative = self.speculative
        for req in reqs:
            budget = step.token_budget
            if budget <= 0 or step.seq_budget <= 0:
                break  # a full step stays full: only preemption frees budget, and that needs a request scheduled
            if step.num_preempted != preempted and req not in running:
                continue  # preempted for an older request earlier in this loop
            if in_flight and req.request_id in in_flight:
                continue  # its last batch has not come back yet
            n = len(req.all_token_ids) - req.num_computed_tokens
            if budget < n:
                n = budget
            if max_tokens and max_tokens < n:
                n = max_tokens
            if n <= 0:
                continue
            spec = 0
            if speculative and n == len(req.all_token_ids) - req.num_computed_tokens == 1 and req.spec_token_ids:
                # a decode verifies its proposals in the same chunk: they count against the budget like any token
                spec = min(len(req.spec_token_ids), budget - 1, (max_tokens or budget) - 1)
                n += spec
            owned = owned_blocks(req.request_id)
            if owned is None or req.num_computed_tokens + n > len(owned) * block_size:  # else it fits its blocks
                if spec and not kv.allocate_slots(req, n):  # proposals never preempt: without room they wait
                    n -= spec
                    spec = 0
                if not spec and not self._make_room(req, n, step):
                    continue
            add(req, n, spec)
            if caching:  # proposals are not tokens of the request yet: only its own ones are indexed
                kv.cache_blocks(req, req.num_computed_tokens + n - spec)

    def _make_room(self, req: Request, n: int, step: StepBuilder) -> bool:
        """Allocate `n` slots for `req`, preempting the newest requests until they fit; False if they can't."""
        while not self.kv.allocate_slots(req, n):
            victim = self._preemption_victim()
            if victim is None:
                return False  # everything else is in flight: wait for it
            self.preempt(victim, step)
            if victim is req:
                return False
        return True

    def _preemption_victim(self) -> Request | None:
        """The newest running request that is not in a batch in flight."""
        order, in_flight = self._order, self.in_flight
        candidates = [r for r in self.running if r.request_id not in in_flight] if in_flight else self.running
        return max(candidates, key=lambda r: order[r.request_id]) if candidates else None

    # ---- LoRA adapter slots ---------------------------------------------------------------
    def lora_blocked(self, req: Request) -> bool:
        """Its adapter would be one more than `max_loras` among the running requests' adapters: it waits."""
        lora_id = req.lora_id
        return bool(lora_id) and self.max_loras is not None and lora_id not in self.running_loras and \
            len(self.running_loras) >= self.max_loras

    def next_waiting(self) -> Request | None:
        """The waiting request to try next: the first in line (FCFS), except that requests whose LoRA adapter
        has no slot are passed over, so one cannot hold up the requests behind it."""
        if self.max_loras is None:
            return self.waiting[0] if self.waiting else None
        return next((r for r in self.waiting if not self.lora_blocked(r)), None)

    def _lora_left(self, req: Request) -> None:
        lora_id = req.lora_id
        if lora_id and self.max_loras is not None:
            self.running_loras[lora_id] -= 1
            if self.running_loras[lora_id] <= 0:
                del self.running_loras[lora_id]

    def admit(self, req: Request, step: StepBuilder, max_tokens: int | None = None) -> bool:
        """Move a waiting request into running with its first chunk, if the seat, budget, KV and (with LoRA) an
        adapter slot allow."""
        if step.seq_budget <= 0 or step.token_budget <= 0 or len(self.running) >= self.config.max_num_seqs:
            return False
        if self.max_loras is not None and self.lora_blocked(req):
            return False
        imported = req.num_computed_tokens  # > 0 only when its KV was imported (blocks adopted, see kv.adopt)
        computed = [] if imported else self.kv.get_computed_blocks(req)
        num_cached = imported or len(computed) * self.kv.block_size
        n = min(req.num_tokens - num_cached, step.token_budget, max_tokens or 1 << 62)
        if not self.kv.allocate_slots(req, n, computed):
            return False
        self.waiting.remove(req)
        if req.times.first_scheduled is None:
            req.times.first_scheduled = self.clock.now()
            req.num_cached_tokens = len(computed) * self.kv.block_size
        req.num_computed_tokens = num_cached
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        if req.lora_id and self.max_loras is not None:
            self.running_loras[req.lora_id] += 1
        step.add(req, n)
        self.kv.cache_blocks(req, num_cached + n)
        return True

    def preempt(self, req: Request, step: StepBuilder) -> None:
        """Recompute-style preemption: drop the KV, keep the tokens, requeue at the front."""
        step.remove(req)
        step.num_preempted += 1
        self.running.remove(req)
        self._lora_left(req)
        self.kv.free(req, uncomputed_from=req.num_computed_tokens)
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions_total += 1
        self.waiting.appendleft(req)
        logger.debug("preempted %s (%d tokens to recompute)", req.request_id, req.num_tokens)

    # ---- one step ------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        step = StepBuilder(self.config.max_num_batched_tokens, self.config.max_num_seqs)
        self.policy.schedule(self, step)
        chunks = tuple(step.chunks.values())
        self.in_flight.update(step.chunks)
        if chunks:
            self._last_step_phase = "prefill" if step.has_prefill else "decode"
        # Finished ids ride only on a batch that will run (drivers skip empty ones), else on take_finished_ids().
        finished = self.take_finished_ids() if chunks else ()
        return SchedulerOutput(
            chunks=chunks,
            block_tables=self.kv.block_tables(step.chunks),
            finished_ids=finished,
        )

    def take_finished_ids(self) -> tuple[str, ...]:
        """The ids of requests that left since they were last handed out (each id is handed out once)."""
        finished, self._finished_since_step = tuple(self._finished_since_step), []
        return finished

    def update(self, output: SchedulerOutput, result: StepResult) -> list[Request]:
        """Account a finished step: advance computed tokens, append sampled tokens, finish requests."""
        now = self.clock.now()
        done = []
        sampled = result.sampled
        in_flight = self.in_flight
        for chunk in output.chunks:
            req = chunk.request
            in_flight.discard(req.request_id)
            if req.status is not _RUNNING:
                continue  # finished (aborted) or preempted while the step ran
            if chunk.num_spec_tokens:
                if self._accept_verified(req, chunk, result.spec_tokens[req.request_id], now):
                    done.append(req)
                continue
            req.num_computed_tokens += chunk.num_tokens
            if not chunk.samples:
                continue
            req.append_output_token(sampled[req.request_id])
            times = req.times
            if times.first_token is None:
                times.first_token = now
            times.last_token = now
            status = req.check_stop_token()
            if status is not None:
                self.finish_request(req, status)
                done.append(req)
        return done

    def _accept_verified(self, req: Request, chunk, tokens: list[int], now: float) -> bool:
        """Account a decode that verified proposals: `tokens` are its accepted proposals then the target's own
        token. KV counts as computed through the accepted proposals only (the slots of rejected ones are written
        again next step); tokens stop at the first stop condition. True if the request finished."""
        req.num_computed_tokens += chunk.num_tokens - chunk.num_spec_tokens + len(tokens) - 1
        times = req.times
        if times.first_token is None:
            times.first_token = now
        times.last_token = now
        for token in tokens:
            req.append_output_token(token)
            status = req.check_stop_token()
            if status is not None:
                self.finish_request(req, status)
                return True
        return False
