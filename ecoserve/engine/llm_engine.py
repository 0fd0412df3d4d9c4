"""LLMEngine: requests in, scheduler + executor each step, RequestOutputs (with text) out."""
from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Sequence

import torch

from ecoserve.clock import Clock, WallClock
from ecoserve.config import EngineConfig
from ecoserve.engine.kv_cache import PagedKVCache, resolve_cache_dtype
from ecoserve.engine.cpu import tune_allocator
from ecoserve.engine.detokenizer import IncrementalDetokenizer
from ecoserve.engine.guided import GrammarCompiler, GuidedDecoder, compile_error
from ecoserve.engine.model_runner import ModelRunner
from ecoserve.request import (CompletionOutput, Logprobs, LoRARequest, OutputHistory, Request, RequestMetrics,
                              RequestOutput, RequestStatus)
from ecoserve.sampling import SEED_MAX, SEED_MIN, SamplingParams
from ecoserve.sched.interface import SchedulerOutput
from ecoserve.sched.scheduler import Scheduler

logger = logging.getLogger(__name__)


def validate_params(params: SamplingParams, vocab_size: int, has_tokenizer: bool) -> SamplingParams:
    """Checks that need the model or tokenizer; returns the params to run with (also a cluster frontend's).

    Every field is checked again, so params changed after construction fail here, not inside a step."""
    params.validate()
    bad = [t for t in (params.logit_bias or {}) if t >= vocab_size]
    if bad:
        raise ValueError(f"logit_bias token ids must be in [0, {vocab_size}), got {bad[:5]}")
    if not has_tokenizer:
        if params.stop or params.structured_outputs is not None:
            raise ValueError("stop strings and structured outputs need a tokenizer, and this engine has none "
                             "(skip_tokenizer_init)")
        if params.detokenize:
            params = params.clone(detokenize=False)
    return params

DEFAULT_CPU_KV_BYTES = 1 << 30
PromptType = str | list[int] | dict[str, Any]
SAMPLE_ID_SEP = "\x1f"  # reserved: user ids never contain it, so sample ids never collide with them


def sample_id(request_id: str, index: int) -> str:
    """The scheduler's id of sample `index` of an n > 1 request."""
    return f"{request_id}{SAMPLE_ID_SEP}{index}"


def sample_seed(seed: int, index: int) -> int:
    """Sample `index`'s seed: `seed + index`, wrapped into the int64 range a seed must stay in."""
    span = SEED_MAX - SEED_MIN + 1
    return (seed + index - SEED_MIN) % span + SEED_MIN


class RequestFailedError(RuntimeError):
    """One request raised inside a step; it alone was aborted and the engine went on."""


@dataclass
class _Child:
    """One of the n samples of a user request: its detokenizer, what it emitted, and this step's delta."""

    request: Request
    index: int
    detokenizer: IncrementalDetokenizer
    cumulative_logprob: float | None
    history: OutputHistory = field(default_factory=OutputHistory)
    num_processed: int = 0
    new_token_ids: list[int] = field(default_factory=list)
    new_logprobs: list[Logprobs] | None = None


@dataclass
class _Parent:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    children: list[_Child] = field(default_factory=list)
    prompt_logprobs: list[Logprobs | None] | None = None

    @property
    def finished(self) -> bool:
        return all(c.request.finished for c in self.children)


@dataclass
class _GrammarWait:
    """A request whose grammar is still compiling: its samples are held out of scheduling until `future` is done."""

    parent: _Parent
    future: Future
    deadline: float  # time.monotonic() after which it fails
    timeout_s: float  # the compile timeout it was added with (for its error)
    accepted: tuple[int, ...] = ()  # tokens its grammar already took elsewhere (the prompt's tail)


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, clock: Clock | None = None, **kwargs: Any) -> None:
        from ecoserve.model.loader import load_model

        config = config or EngineConfig(**kwargs)
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        if config.device == "cpu":
            tune_allocator()
        self.clock = clock or WallClock()
        parallel = config.parallel
        loaded = load_model(config.model, dtype=config.dtype, device=config.device, revision=config.revision,
                            tokenizer=config.tokenizer, skip_tokenizer_init=config.skip_tokenizer_init,
                            weights=parallel.world_size == 1, quantization=config.quantization,
                            cpu_linear=config.cpu_linear, quantize_lm_head=config.quantize_lm_head)
        self.loaded = loaded
        self.expert_pool = None
        if config.moe_resident_experts is not None:  # MoE experts placed between host and device memory
            if parallel.world_size > 1:
                raise ValueError("--moe-resident-experts runs in a single-process instance, not under TP/PP")
            from ecoserve.model.expert_pool import ExpertPool

            self.expert_pool = ExpertPool.attach(loaded.model, config.moe_resident_experts)
        self.model_name = loaded.name
        self.tokenizer = loaded.tokenizer
        self.eos_token_ids = frozenset(loaded.eos_token_ids)
        self.max_model_len = config.scheduler.max_model_len or loaded.max_model_len
        block_size = config.cache.block_size
        per_token = self.kv_bytes_per_token()
        # Default budget: 1 GiB, or less when even max_num_seqs requests at max_model_len need less.
        budget = config.cache.kv_cache_memory_bytes or min(
            DEFAULT_CPU_KV_BYTES, per_token * self.max_model_len * config.scheduler.max_num_seqs)
        num_blocks = config.cache.num_gpu_blocks or budget // (per_token * block_size)
        capacity = num_blocks * block_size
        if capacity < self.max_model_len:
            raise ValueError(f"the KV cache holds {capacity} tokens ({num_blocks} blocks of {block_size}), fewer than "
                             f"max_model_len ({self.max_model_len}); raise the KV budget or lower max_model_len")
        logger.info("KV cache: %d blocks x %d tokens = %d tokens (%.1f MiB, %s); max concurrency at max_model_len "
                    "%d: %.2fx", num_blocks, block_size, capacity, capacity * per_token / 2**20,
                    str(self.kv_cache_dtype).removeprefix("torch."), self.max_model_len, capacity / self.max_model_len)
        sched_config = config.scheduler
        if sched_config.tdpipe.num_stages is None and parallel.pipeline_parallel_size > 1:  # tdpipe: the real stages
            sched_config = replace(sched_config, tdpipe=replace(sched_config.tdpipe,
                                                                num_stages=parallel.pipeline_parallel_size))
        self.lora = None  # the LoRA adapters (ecoserve.lora.LoRAManager) with --enable-lora
        if config.lora is not None:
            if parallel.world_size > 1:
                raise ValueError("LoRA adapters (--enable-lora) run in a single-process instance; tensor and "
                                 "pipeline parallelism with LoRA are not supported")
            from ecoserve.lora import LoRAManager

            self.lora = LoRAManager(loaded.model, config.lora, self.model_name)
        self.scheduler = Scheduler(sched_config, config.cache, num_blocks, self.clock, self.max_model_len,
                                   max_loras=config.lora.max_loras if config.lora is not None else None)
        # Matchers of constrained sequences live here, in the engine's process (also in a cluster instance).
        self.guided = GuidedDecoder(GrammarCompiler(self.tokenizer, loaded.spec.vocab_size, sorted(self.eos_token_ids),
                                                    config.structured_outputs.cache_size)
                                    ) if self.tokenizer is not None else None
        self.grammar_compile_timeout_s = config.structured_outputs.compile_timeout_s
        self._grammar_waits: dict[str, _GrammarWait] = {}
        self.on_grammar_ready: Callable[[], None] | None = None  # called on the grammar thread: wake the stepper
        if parallel.world_size == 1:
            loaded.model.ensure_positions(self.max_model_len)
            self.executor = ModelRunner(loaded.model, num_blocks, block_size, config.device, config.seed,
                                        self.kv_cache_dtype, lora=self.lora)
        else:
            from ecoserve.distributed.launch import start_workers
            self.executor = start_workers(config, loaded, num_blocks, self.max_model_len)
        # Submitted batches, oldest first, with their futures: up to max_concurrent_batches (pp by default) run at
        # once; the scheduler's in-flight set keeps their requests out of later batches until each result is back.
        self.max_in_flight = parallel.batches_in_flight
        self._in_flight: deque[tuple[SchedulerOutput, Any]] = deque()
        self._parents: dict[str, _Parent] = {}
        self._child_to_parent: dict[str, _Parent] = {}
        self._failed: dict[str, Exception] = {}  # requests that failed after add_request returned, until take_failed()
        self.stats = {"prompt_tokens": 0, "generation_tokens": 0}
        self.last_step_empty = False  # the last step() found nothing it could schedule
        self.speculator = None  # speculative decoding (--speculative-config): proposals before each step
        if config.speculative is not None:
            from ecoserve.engine.spec_decode.speculator import build_speculator

            self.speculator = build_speculator(config, loaded, num_blocks)
            self.scheduler.speculative = True

    @property
    def model_dtype(self) -> torch.dtype:
        """The dtype of weights and activations (resolved from --dtype as every rank resolves it)."""
        if self.loaded.model is not None:
            return self.loaded.model.dtype
        from ecoserve.model.loader import resolve_dtype

        config = self.config
        return resolve_dtype(config.dtype, config.device, self.loaded.spec.torch_dtype, self.loaded.quantization)

    @property
    def kv_cache_dtype(self) -> torch.dtype:
        """The KV cache's element type (--kv-cache-dtype; auto: the model's dtype)."""
        return resolve_cache_dtype(self.config.cache.cache_dtype, self.model_dtype)

    def kv_bytes_per_token(self) -> int:
        """KV bytes per token on the most loaded rank (the budget is per rank; blocks are the same on all)."""
        config, spec = self.config, self.loaded.spec
        parallel = config.parallel
        if parallel.world_size == 1:
            model = self.loaded.model
            return PagedKVCache.bytes_per_token(model.num_layers, model.num_kv_heads, model.head_dim,
                                                self.kv_cache_dtype)
        from ecoserve.model.parallel import HeadShard, partition_layers

        stages = partition_layers(spec.num_layers, parallel.pipeline_parallel_size, parallel.pp_layer_partition)
        kv_heads = HeadShard.of(spec, parallel.tensor_parallel_size, 0).num_kv_heads
        return max(PagedKVCache.bytes_per_token(len(r), kv_heads, spec.head_dim, self.kv_cache_dtype)
                   for r in stages)

    def check(self) -> None:
        """Raise the executor's error if a rank of a parallel instance has died or stalled, even while idle."""
        check = getattr(self.executor, "check", None)
        if check is not None:
            check()

    def shutdown(self) -> None:
        """Stop the worker processes of a parallel instance (nothing to do in-process)."""
        stop = getattr(self.executor, "shutdown", None)
        if stop is not None:
            stop()

    # ---- requests ------------------------------------------------------------------------
    def tokenize_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("a text prompt needs a tokenizer, and this engine has none (skip_tokenizer_init); "
                                 "pass token ids")
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return self.tokenize_prompt(prompt["prompt"])
            raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            return None, list(prompt)
        raise ValueError(f"a prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}")

    def validate_prompt(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise ValueError("the prompt is empty: at least one token is needed")
        if len(token_ids) > self.max_model_len:
            raise ValueError(f"the prompt has {len(token_ids)} tokens, more than max_model_len "
                             f"({self.max_model_len})")
        vocab = self.loaded.spec.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids must be in [0, {vocab}); got {bad[:5]}")

    def validate_params(self, params: SamplingParams) -> SamplingParams:
        return validate_params(params, self.loaded.spec.vocab_size, self.tokenizer is not None)

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams | None = None,
                    arrival_time: float | None = None, grammar_accepted: Sequence[int] = (),
                    lora_request: LoRARequest | None = None) -> None:
        """Validate and queue; on error nothing is queued and other requests are untouched.

        Never compiles a grammar here: one not compiled yet is compiled on the grammar threads while
        the request waits unscheduled; `step()` starts it when it is ready, or fails it (see
        `take_failed`) at its compile deadline. A grammar already known to be bad raises ValueError.
        `grammar_accepted`: tokens at the end of the prompt that the grammar took on another instance.
        `lora_request`: the adapter to run with (None: the base model); one not registered yet is registered
        (validated) here, and its weights load while the request waits or runs.
        """
        params = self.validate_params(params or SamplingParams())
        if lora_request is not None:
            self.lora_manager().register(lora_request)
        if request_id in self._parents:
            raise ValueError(f"request id {request_id!r} is already in use")
        if SAMPLE_ID_SEP in request_id:
            raise ValueError(f"request ids must not contain {SAMPLE_ID_SEP!r}: it separates the ids of n > 1 "
                             f"samples, got {request_id!r}")
        text, token_ids = self.tokenize_prompt(prompt)
        self.validate_prompt(token_ids)
        grammar, ready = None, True
        if params.structured_outputs is not None:
            grammar = self.guided.compiler.submit(params.structured_outputs)
            ready = grammar.done()  # decided once: the future may finish on its thread at any moment
            if ready and (error := compile_error(grammar)) is not None:
                raise error  # a bad spec, compiled before
        arrival = self.clock.now() if arrival_time is None else arrival_time
        parent = _Parent(request_id, text, token_ids,
                         prompt_logprobs=[None] if params.prompt_logprobs is not None else None)
        for i in range(params.n):
            child_params = params
            if params.n > 1:
                child_params = params.clone(n=1, seed=None if params.seed is None else sample_seed(params.seed, i),
                                            prompt_logprobs=params.prompt_logprobs if i == 0 else None)
            rid = request_id if params.n == 1 else sample_id(request_id, i)
            req = Request(rid, token_ids, child_params, arrival, self.eos_token_ids, self.max_model_len,
                          lora_request=lora_request)
            wants_logprobs = params.logprobs is not None
            parent.children.append(_Child(req, i, IncrementalDetokenizer(self.tokenizer, token_ids, child_params),
                                          0.0 if wants_logprobs else None,
                                          OutputHistory(logprobs=[] if wants_logprobs else None)))
        for child in parent.children:  # all of them, before any is queued
            self.scheduler.check_request(child.request)
        accepted = tuple(grammar_accepted)
        for child in parent.children:
            self.scheduler.add_request(child.request, wait_for_grammar=not ready)
            self._child_to_parent[child.request.request_id] = parent
            if grammar is not None and ready:
                self.guided.start(child.request.request_id, grammar.result(), accepted)
        self._parents[request_id] = parent
        self.stats["prompt_tokens"] += len(token_ids)
        if not ready:
            self._grammar_waits[request_id] = _GrammarWait(
                parent, grammar, time.monotonic() + self.grammar_compile_timeout_s, self.grammar_compile_timeout_s,
                accepted)
            wake = self.on_grammar_ready
            if wake is not None:
                grammar.add_done_callback(lambda _: wake())

    def resume_output(self, request_id: str, num_output_tokens: int, num_output_chars: int) -> None:
        """The last `num_output_tokens` prompt ids of a queued request are output produced elsewhere, whose
        first `num_output_chars` characters the client has: its text continues after them (no gap, no repeat)."""
        parent = self._parents[request_id]
        if not 0 < num_output_tokens < len(parent.prompt_token_ids) or self.tokenizer is None:
            return
        prompt, produced = parent.prompt_token_ids[:-num_output_tokens], parent.prompt_token_ids[-num_output_tokens:]
        for c in parent.children:
            c.detokenizer = IncrementalDetokenizer.resumed(self.tokenizer, prompt, produced,
                                                           c.request.sampling_params, num_output_chars)

    def abort_request(self, request_ids: str | list[str]) -> list[str]:
        """Abort unfinished requests and free their KV; returns the ids that were still unfinished."""
        aborted = []
        for rid in [request_ids] if isinstance(request_ids, str) else request_ids:
            parent = self._parents.pop(rid, None)
            if parent is None:
                continue
            self.scheduler.abort_requests([c.request.request_id for c in parent.children])
            self._grammar_waits.pop(rid, None)
            self._forget(parent)
            aborted.append(rid)
        if aborted and not self.scheduler.has_unfinished_requests():
            self.flush_finished()
        return aborted

    def has_unfinished_requests(self) -> bool:
        """Requests not finished, or batches still in flight (e.g. of requests aborted meanwhile)."""
        return bool(self._parents or self._in_flight)

    def get_num_unfinished_requests(self) -> int:
        return len(self._parents)

    # ---- LoRA adapters ----------------------------------------------------------------------
    def lora_manager(self):
        """The engine's `ecoserve.lora.LoRAManager`; a clear error when LoRA is off."""
        if self.lora is None:
            raise ValueError("LoRA adapters are not enabled on this engine; start it with enable_lora=True "
                             "(--enable-lora)")
        return self.lora

    def add_lora(self, lora: LoRARequest) -> None:
        """Validate an adapter and read it into the host cache; raises LoRAAdapterError (a ValueError) saying
        what is wrong with it, and nothing else changes."""
        self.lora_manager().add_lora(lora)

    def remove_lora(self, name: str) -> bool:
        """Forget an adapter (requests using it still finish); False if none has that name."""
        return self.lora is not None and self.lora.remove_lora(name)

    def list_loras(self) -> list[LoRARequest]:
        return [] if self.lora is None else self.lora.list_loras()

    def lora_stats(self):
        """`ecoserve.lora.LoRAStats`: running and waiting adapters, max_lora (0 with LoRA off), loads, evictions."""
        sched = self.scheduler
        if self.lora is None:
            from ecoserve.lora import LoRAStats

            return LoRAStats([], [], 0, 0, 0, 0, 0)
        waiting = [*sched.waiting, *sched.waiting_for_grammar.values()]
        return self.lora.stats((r.lora_request for r in sched.running), (r.lora_request for r in waiting))

    # ---- requests waiting for their grammar ------------------------------------------------
    def grammar_wait_s(self) -> float | None:
        """Seconds until something can change when every unfinished request waits for a grammar that is not
        ready (the earliest compile deadline; a grammar's completion calls `on_grammar_ready` sooner); None
        when a step could do work now."""
        waits = self._grammar_waits
        if not waits or self._in_flight or self.scheduler.has_unfinished_requests():
            return None
        if any(w.future.done() for w in waits.values()):
            return None
        return max(0.0, min(w.deadline for w in waits.values()) - time.monotonic())

    def wait_for_grammars(self, timeout_s: float) -> None:
        """Block up to `timeout_s` until a pending grammar is compiled (for a caller that steps in a loop and has
        nothing else to do: see `grammar_wait_s`)."""
        futures = [w.future for w in self._grammar_waits.values()]
        if futures:
            wait(futures, timeout=timeout_s, return_when=FIRST_COMPLETED)

    def _start_ready_grammars(self) -> None:
        """Requests whose grammar is compiled join the scheduler's queue; a bad grammar, or one past its compile
        deadline, fails its request alone. A cheap poll of futures: never blocks."""
        now = time.monotonic()
        for rid, w in list(self._grammar_waits.items()):
            if w.future.done():
                error = compile_error(w.future)
                if error is None:
                    del self._grammar_waits[rid]
                    for child in w.parent.children:
                        self.guided.start(child.request.request_id, w.future.result(), w.accepted)
                        self.scheduler.grammar_ready(child.request.request_id)
                    continue
            elif now >= w.deadline:
                spec = w.parent.children[0].request.sampling_params.structured_outputs
                error = ValueError(f"the structured output grammar ({spec.kind}) did not compile within "
                                   f"{w.timeout_s:g} s; simplify it (the limit is "
                                   f"--grammar-compile-timeout)")
            else:
                continue
            del self._grammar_waits[rid]
            self._fail_waiting(w.parent, error)

    def _fail_waiting(self, parent: _Parent, error: Exception) -> None:
        """End a request that waited for its grammar with an error that `take_failed` reports; nothing else is
        touched."""
        self.scheduler.abort_requests([c.request.request_id for c in parent.children])
        self._parents.pop(parent.request_id, None)
        self._forget(parent)
        self._failed[parent.request_id] = error

    # ---- one step ------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Submit batches while fewer than max_concurrent_batches are in flight and the scheduler has work, then
        take the oldest batch's result; returns one delta output per request that got new tokens or finished.

        With one batch in flight (the default without pipeline parallelism) this is schedule, run, update.
        """
        if self._grammar_waits:
            self._start_ready_grammars()
        in_flight = self._in_flight
        while len(in_flight) < self.max_in_flight:
            if self.speculator is not None:
                out, future = self._submit_speculative()
                if future is None:
                    break
            else:
                out = self.scheduler.schedule()
                if out.is_empty:
                    break
                future = self.executor.submit(out, self._grammar_masks(out))
            if self.lora is not None:  # the adapters of waiting requests load while this batch runs
                sched = self.scheduler
                self.lora.prefetch(itertools.islice((r.lora_request for r in sched.waiting), 4 * sched.max_loras),
                                   sched.running_loras)
            in_flight.append((out, future))
        self.last_step_empty = not in_flight
        if not in_flight:
            self.flush_finished()
            return []
        out, future = in_flight.popleft()
        result = future.result()  # raises if a rank died or stalled: the engine is dead then
        if self.speculator is not None:
            self.speculator.record(out, result)
        self.scheduler.update(out, result)
        if self.lora is not None:
            self._fail_broken_adapters()
        touched: dict[str, _Parent] = {}
        for chunk in out.chunks:
            parent = self._child_to_parent.get(chunk.request.request_id)
            if parent is None:
                continue
            child = parent.children[0] if len(parent.children) == 1 else next(
                c for c in parent.children if c.request is chunk.request)
            rid = chunk.request.request_id
            try:
                if rid in result.prompt_logprobs and parent.prompt_logprobs is not None:
                    have = len(parent.prompt_logprobs)
                    new = result.prompt_logprobs[rid]
                    skip = have - 1 - chunk.start  # positions already recorded before a preemption
                    parent.prompt_logprobs.extend(new[max(skip, 0):])
                if rid in result.sampled:
                    self._process_token(child, result)
                    touched[parent.request_id] = parent
            except Exception as e:  # this request's own processing: it fails alone
                self._fail_request(parent, e)
        outputs = []
        for parent in touched.values():
            if parent.request_id not in self._parents:
                continue  # failed after it was touched
            try:
                outputs.append(self._make_output(parent))
            except Exception as e:
                self._fail_request(parent, e)
                continue
            if parent.finished:
                del self._parents[parent.request_id]
                self._forget(parent)
        if not self.scheduler.has_unfinished_requests():
            self.flush_finished()
        return outputs

    def _fail_request(self, parent: _Parent, error: Exception) -> None:
        """Abort one request whose own step processing raised; its error waits for `take_failed`."""
        logger.exception("request %s failed in the engine step; it is aborted, the engine goes on",
                         parent.request_id, exc_info=error)
        if self._parents.pop(parent.request_id, None) is None:
            return
        self.scheduler.abort_requests([c.request.request_id for c in parent.children])
        self._forget(parent)
        self._failed[parent.request_id] = RequestFailedError(
            f"request {parent.request_id!r} failed in the engine and was aborted: {type(error).__name__}: {error}")

    def _fail_broken_adapters(self) -> None:
        """Fail (alone) the requests of adapters whose weights could not be loaded during this step."""
        for lora, error in self.lora.take_failed():
            for parent in [p for p in self._parents.values() if p.children[0].request.lora_id == lora.lora_int_id]:
                self._fail_request(parent, RuntimeError(f"LoRA adapter {lora.lora_name!r} could not be loaded from "
                                                        f"{lora.lora_path}: {error}"))

    def take_failed(self) -> dict[str, Exception]:
        """The requests steps failed since the last call (each aborted alone: a grammar past its deadline, an
        exception in its own processing), with their errors."""
        failed, self._failed = self._failed, {}
        return failed

    def _submit_speculative(self) -> tuple[SchedulerOutput, Any]:
        """Propose, schedule and submit one step with speculation: constrained requests' proposals are cut to what
        their grammar takes, and their masks cover every verified position."""
        guided = self.guided if self.guided is not None and len(self.guided) else None
        trim = None if guided is None else guided.valid_prefix
        self.speculator.propose(self.scheduler.running, trim)
        out = self.scheduler.schedule()
        if out.is_empty:
            return out, None
        masks = None
        if guided is not None:
            proposals = {c.request.request_id: c.request.spec_token_ids[:c.num_spec_tokens]
                         for c in out.chunks if c.num_spec_tokens}
            masks = guided.masks([c.request.request_id for c in out.chunks if c.samples], proposals)
        return out, self.executor.submit(out, masks, self.speculator.draft_probs())

    def _grammar_masks(self, out: SchedulerOutput):
        """Bitmasks of the batch's constrained sampling rows, from matchers that have seen every earlier token."""
        guided = self.guided
        if guided is None or not len(guided):
            return None
        return guided.masks([c.request.request_id for c in out.chunks if c.samples])

    def _forget(self, parent: _Parent) -> None:
        for c in parent.children:
            self._child_to_parent.pop(c.request.request_id, None)
            if self.guided is not None:
                self.guided.remove(c.request.request_id)
        if self.speculator is not None:
            self.speculator.forget([c.request.request_id for c in parent.children])

    def flush_finished(self) -> None:
        """Hand the executor the ids of requests that left since its last batch, so it drops their state.

        The scheduler keeps them for its next non-empty batch; an idle engine flushes them at once
        (a request id reused later must start afresh, e.g. with a new seeded generator).
        """
        finished = self.scheduler.take_finished_ids()
        if finished:
            self.executor.execute(SchedulerOutput((), {}, finished_ids=finished))

    def _process_token(self, child: _Child, result) -> None:
        req = child.request
        rid = req.request_id
        spec_logprobs = result.spec_logprobs.get(rid) if result.spec_logprobs else None
        first_new = child.num_processed
        while child.num_processed < req.num_output_tokens:
            token = req.output_token_ids[child.num_processed]
            child.num_processed += 1
            self.stats["generation_tokens"] += 1
            child.new_token_ids.append(token)
            if child.cumulative_logprob is not None and (spec_logprobs is not None or rid in result.logprobs):
                if child.new_logprobs is None:
                    child.new_logprobs = []
                if spec_logprobs is not None:  # several tokens this step (speculative decoding): one entry each
                    j = child.num_processed - 1 - first_new
                    child.new_logprobs.append(spec_logprobs[j])
                    child.cumulative_logprob += result.spec_sampled_logprobs[rid][j]
                else:
                    child.new_logprobs.append(result.logprobs[rid])
                    child.cumulative_logprob += result.sampled_logprob[rid]
            stop = child.detokenizer.append(token)
            ended = False
            if stop is not None and not req.finished and child.num_processed >= req.sampling_params.min_tokens:
                req.stop_reason = stop
                self.scheduler.finish_request(req, RequestStatus.FINISHED_STOPPED)
                ended = True
            if self.guided is not None and self.guided.accept(rid, token) and not req.finished:
                self.scheduler.finish_request(req, RequestStatus.FINISHED_STOPPED)  # the grammar is complete
                ended = True
            if ended and child.num_processed < req.num_output_tokens:  # tokens past the stop (speculation's)
                del req.output_token_ids[child.num_processed:]
                del req.all_token_ids[req.num_prompt_tokens + child.num_processed:]
                break

    def _make_output(self, parent: _Parent) -> RequestOutput:
        """This step's deltas of every sample (empty for samples without news), O(new tokens)."""
        outs = []
        for c in parent.children:
            req = c.request
            reason = req.status.value if req.finished else None
            new_text = c.detokenizer.take_new_text(final=req.finished)
            new_logprobs = c.new_logprobs if c.new_logprobs is not None else (
                None if c.history.logprobs is None else [])
            c.history.extend(c.new_token_ids, new_text, new_logprobs)
            outs.append(CompletionOutput(c.index, new_text, c.new_token_ids, c.cumulative_logprob, new_logprobs,
                                         reason, req.stop_reason, c.history))
            c.new_token_ids, c.new_logprobs = [], None
        first = parent.children[0].request
        times = first.times
        metrics = RequestMetrics(times.arrival, times.first_scheduled, times.first_token, times.last_token,
                                 times.finished, sum(c.request.num_preemptions for c in parent.children),
                                 first.num_cached_tokens)
        return RequestOutput(parent.request_id, parent.prompt, parent.prompt_token_ids, parent.prompt_logprobs,
                             outs, parent.finished, metrics, first.num_cached_tokens)
