"""A simulated instance: the live `Scheduler` driven by a `SimulatedExecutor` on virtual time."""
from __future__ import annotations

from ecoserve.clock import VirtualClock
from ecoserve.cluster.status import InstanceStatus, instance_status
from ecoserve.config import CacheConfig, SchedulerConfig
from ecoserve.request import Request
from ecoserve.sampling import SamplingParams
from ecoserve.sched.interface import SchedulerOutput, StepResult, is_prefill
from ecoserve.sched.scheduler import Scheduler
from ecoserve.sim.lora import AdapterCache
from ecoserve.sim.perf import StepWork


class SimulatedExecutor:
    """Returns a token per sampling chunk and the performance model's predicted step time.

    Tokens whose KV arrived from elsewhere (FuDG imports) cost nothing to "compute". With `adapters`,
    requests with a `lora_request` run through their LoRA adapter: rank x tokens of compute, and a load for
    an adapter the instance lacks.
    """

    def __init__(self, perf, token_id: int = 0, adapters: AdapterCache | None = None) -> None:
        self.perf = perf
        self.token_id = token_id
        self.imported: dict[str, int] = {}  # request id -> tokens whose KV was transferred in
        self.adapters = adapters

    def execute(self, batch: SchedulerOutput) -> StepResult:
        tokens = seqs = sampled_n = kv = prompt_tokens = 0
        pairs = 0.0
        sampled = {}
        verifying = []  # decode chunks that carry proposals (speculative decoding)
        imported = self.imported
        token_id = self.token_id
        for c in batch.chunks:
            rid = c.request.request_id
            start, q, spec = c.start, c.num_tokens, c.num_spec_tokens
            if imported and rid in imported:
                free_upto = imported[rid]
                if start < free_upto:
                    q -= min(free_upto, start + q) - start
                    start = min(free_upto, start + c.num_tokens)
            if c.samples:
                sampled[rid] = token_id
                sampled_n += 1 + spec
            if spec:
                verifying.append(c)
            if q <= 0:
                continue
            tokens += q
            seqs += 1
            if is_prefill(q - spec, c.samples):
                prompt_tokens += q
            pairs += q * start + q * (q + 1) / 2  # causal (query, key) pairs; a decode's is start + 1
            kv += start + q
        result = StepResult(sampled=sampled)
        if tokens:
            work = StepWork(tokens, seqs, sampled_n, pairs, kv, prompt_tokens)
            result.duration = self._lora_step(batch, work) if self.adapters is not None else self.perf.work_time(work)
        if verifying:
            self.verify(verifying, result)
        return result

    def verify(self, chunks: list, result: StepResult) -> None:
        """Speculative decoding's acceptance and draft cost (sim/speculation.py); a plain instance has none."""
        raise RuntimeError("a decode carried proposals, but this simulated instance does not speculate")

    def _lora_step(self, batch: SchedulerOutput, work: StepWork) -> float:
        adapters = self.adapters
        lora_chunks = [c for c in batch.chunks if c.request.lora_request is not None]
        used = {c.request.lora_request.lora_name for c in lora_chunks}
        rank_tokens = adapters.config.rank * sum(c.num_tokens for c in lora_chunks)
        compute = self.perf.work_time(work._replace(lora_rank_tokens=rank_tokens,
                                                    lora_weight_bytes=len(used) * adapters.adapter_bytes))
        return adapters.step_time(compute, adapters.load_time(used))


class SimInstance:
    """One model instance in virtual time: a scheduler, its executor, and step bookkeeping."""

    def __init__(self, instance_id: int, perf, clock: VirtualClock, sched_config: SchedulerConfig,
                 num_blocks: int, block_size: int = 16, max_model_len: int | None = None,
                 executor: SimulatedExecutor | None = None, adapters: AdapterCache | None = None) -> None:
        self.instance_id = instance_id
        self.clock = clock
        self.executor = executor or SimulatedExecutor(perf, adapters=adapters)
        self.sched = Scheduler(sched_config, CacheConfig(block_size=block_size, num_gpu_blocks=num_blocks,
                                                         enable_prefix_caching=False),
                               num_blocks, clock, max_model_len=max_model_len,
                               max_loras=adapters.config.max_loras if adapters is not None else None)
        # speculative decoding (sim/speculation.py): the executor proposes before each schedule
        self.speculating = self.sched.speculative = hasattr(self.executor, "propose")
        self.busy = False
        self._out: SchedulerOutput | None = None
        self._result: StepResult | None = None
        self._first: list[Request] = []  # requests whose first token the running step samples
        self.decode_start: dict[str, float] = {}
        self._status: InstanceStatus | None = None
        self.busy_time = 0.0
        self.num_steps = 0

    # ---- requests -------------------------------------------------------------------------
    def add(self, request_id: str, prompt_len: int, max_tokens: int, imported_tokens: int = 0,
            lora_name: str | None = None) -> Request:
        adapters = self.executor.adapters
        lora = adapters.request_of(lora_name) if lora_name is not None and adapters is not None else None
        req = Request(request_id, [0] * prompt_len, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                      arrival_time=self.clock.now(), lora_request=lora)
        if imported_tokens:
            self.executor.imported[request_id] = imported_tokens
        self.sched.add_request(req)
        self._status = None
        return req

    def open_window(self) -> None:
        self.sched.open_window()
        self._status = None

    def close_window(self) -> None:
        self.sched.close_window()
        self._status = None

    # ---- steps ----------------------------------------------------------------------------
    def try_start(self) -> float | None:
        """Start a step if idle and there is work; return its end time."""
        if self.busy or not self.sched.has_unfinished_requests():
            return None
        if self.speculating:
            self.executor.propose(self.sched.running)
        out = self.sched.schedule()
        if out.is_empty:
            return None
        now = self.clock.now()
        imported = self.executor.imported
        decode_start = self.decode_start
        first = self._first = []
        for c in out.chunks:
            if c.samples:
                req = c.request
                if req.output_token_ids or req.request_id in imported:
                    if req.request_id not in decode_start:
                        decode_start[req.request_id] = now
                if not req.output_token_ids:
                    first.append(req)
        result = self.executor.execute(out)
        self._out, self._result, self.busy = out, result, True
        self.busy_time += result.duration
        self.num_steps += 1
        self._status = None
        return now + max(result.duration, 1e-9)

    def finish_step(self) -> tuple[list[Request], list[Request]]:
        """Account the step that ended: (requests that got their first token, requests that finished)."""
        out, result, first = self._out, self._result, self._first
        self._out = self._result = None
        self.busy = False
        finished = self.sched.update(out, result)
        for req in finished:
            self.executor.imported.pop(req.request_id, None)
        self._status = None
        return first, finished

    def status(self) -> InstanceStatus:
        if self._status is None:
            adapters = self.executor.adapters
            self._status = instance_status(self.instance_id, self.sched,
                                           tuple(adapters.resident) if adapters is not None else ())
        return self._status
