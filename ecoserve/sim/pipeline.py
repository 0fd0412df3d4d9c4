"""A tensor/pipeline-parallel instance in virtual time: the live Scheduler, batches in flight, one timeline per stage.

A batch submitted at time t starts on stage 0 when that stage is free, and on stage s > 0 when
stage s - 1 has passed it on (its compute plus the point-to-point send of the hidden states)
and stage s is free; its tokens come back when the last stage ends. The instance keeps up to
`max_in_flight` batches submitted (pp for a pipeline), and the scheduler's in-flight set keeps
a request out of new batches until its result is back. With virtual engines (vLLM's PP) the
instance has one scheduler per stage instead, each with one batch in flight. So a PP baseline,
TD-Pipe and a TP instance all run through the same scheduler and policy code as a live engine.
"""
from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field, replace

from ecoserve.clock import VirtualClock
from ecoserve.config import CacheConfig, SchedulerConfig
from ecoserve.request import Request
from ecoserve.sampling import SamplingParams
from ecoserve.sched.scheduler import Scheduler
from ecoserve.sim.hardware import GPU, Link
from ecoserve.sim.instance import SimulatedExecutor
from ecoserve.sim.models import ModelSpec
from ecoserve.sim.network import allreduce_time, send_time
from ecoserve.sim.perf import StepWork
from ecoserve.sim.workload import SimRequest


@dataclass
class ParallelPerf:
    """Stage time of a tp x pp instance from a single-GPU performance model (e.g. the measured L20 table).

    Each GPU holds 1/(tp*pp) of the weights and of the KV, so the single-GPU time of a step is
    split tp*pp ways; each stage adds two all-reduces per layer of its tensor-parallel group over
    `link` (the network model), and a send of the hidden states to the next stage.
    """

    base: object  # a PerfModel of the whole model on one GPU
    model: ModelSpec
    tp: int = 1
    pp: int = 1
    link: Link | None = None

    def stage_time(self, work: StepWork) -> float:
        t = self.base.work_time(work) / (self.tp * self.pp)
        if self.tp > 1 and work.num_tokens:
            nbytes = work.num_tokens * self.model.hidden_size * self.model.dtype_bytes
            t += 2 * (self.model.num_layers / self.pp) * allreduce_time(nbytes, self.tp, self.link)
        return t

    def send_time(self, num_tokens: int) -> float:
        return send_time(num_tokens * self.model.hidden_size * self.model.dtype_bytes, self.link) if self.pp > 1 else 0.0

    def work_time(self, work: StepWork) -> float:
        """A batch alone in the pipeline: every stage in turn."""
        return self.pp * self.stage_time(work) + (self.pp - 1) * self.send_time(work.num_tokens)


def kv_capacity_blocks(model: ModelSpec, gpu: GPU, num_gpus: int, block_size: int = 16,
                       memory_fraction: float = 0.9) -> int:
    """Blocks of the whole instance: memory_fraction of every GPU, less the weights (KV split evenly)."""
    free = memory_fraction * gpu.memory_bytes * num_gpus - model.weight_bytes
    return max(int(free / model.kv_bytes_per_token) // block_size, 1)


def batch_work(batch) -> StepWork:
    """What the table model reads of a batch: tokens computed, sequences, samples, context tokens."""
    tokens = kv = sampled = 0
    for c in batch.chunks:
        tokens += c.num_tokens
        kv += c.start + c.num_tokens
        sampled += c.samples
    return StepWork(tokens, len(batch.chunks), sampled, 0.0, kv)


@dataclass
class PipelineRun:
    makespan: float
    num_finished: int
    output_tokens: int
    num_batches: int
    num_preemptions: int
    stage_busy: list[float] = field(default_factory=list)
    batch_seqs: list[int] = field(default_factory=list, repr=False)  # sequences in each batch, in submission order

    @property
    def median_batch_seqs(self) -> float:
        """How full the batches were: one scheduler's stragglers show here, not in the mean."""
        return statistics.median(self.batch_seqs) if self.batch_seqs else 0.0

    @property
    def throughput(self) -> float:
        return self.num_finished / self.makespan if self.makespan > 0 else 0.0

    @property
    def output_throughput(self) -> float:
        return self.output_tokens / self.makespan if self.makespan > 0 else 0.0


class PipelineInstance:
    """A tp x pp instance run by one scheduler, or by one scheduler per stage (vLLM's virtual engines).

    One scheduler (the default) owns all blocks and seats and keeps up to `max_in_flight`
    batches in the pipeline. With `virtual_engines`, the instance is split as vLLM's
    pipeline-parallel engine splits it: pp schedulers, each with blocks // pp of the KV and
    `seats_per_engine` seats (max_num_seqs // pp unless given; vLLM gives every virtual engine
    the full max_num_seqs), one batch in flight per scheduler. An arriving request joins the
    scheduler with the fewest unfinished requests (ties to the lowest index), as vLLM's
    LLMEngine.add_request does, and stays there; idle schedulers submit in turn, starting
    after the last one that submitted.
    """

    def __init__(self, perf: ParallelPerf, sched_config: SchedulerConfig, num_blocks: int, block_size: int = 16,
                 max_in_flight: int | None = None, max_model_len: int | None = None,
                 virtual_engines: bool = False, seats_per_engine: int | None = None) -> None:
        self.perf = perf
        self.clock = VirtualClock()
        if virtual_engines:
            seats = seats_per_engine or max(sched_config.max_num_seqs // perf.pp, 1)
            configs = [replace(sched_config, max_num_seqs=seats)] * perf.pp
            blocks, self.in_flight_per_engine = num_blocks // perf.pp, 1
        else:
            configs, blocks = [sched_config], num_blocks
            self.in_flight_per_engine = max_in_flight or perf.pp
        cache = CacheConfig(block_size=block_size, num_gpu_blocks=blocks, enable_prefix_caching=False)
        self.engines = [Scheduler(c, cache, blocks, self.clock, max_model_len=max_model_len) for c in configs]
        self.executor = SimulatedExecutor(perf)  # the sampled tokens
        self.max_in_flight = max_in_flight or perf.pp
        self.stage_free = [0.0] * perf.pp
        self.stage_busy = [0.0] * perf.pp
        self.engine_of: dict[str, int] = {}  # request id -> the scheduler that owns it
        self._next_engine = 0  # the turn: which scheduler is asked first for the next batch
        self.batch_seqs: list[int] = []

    @property
    def sched(self) -> Scheduler:
        """The first (with one scheduler, the only) scheduler."""
        return self.engines[0]

    def _add(self, r: SimRequest, now: float) -> None:
        loads = [len(e.waiting) + len(e.running) for e in self.engines]
        e = loads.index(min(loads))
        self.engine_of[r.request_id] = e
        self.engines[e].add_request(Request(r.request_id, [0] * r.input_len,
                                            SamplingParams(max_tokens=r.output_len, ignore_eos=True), now))

    def _submit(self, engine: int, now: float):
        out = self.engines[engine].schedule()
        if out.is_empty:
            return None
        self.batch_seqs.append(len(out.chunks))
        result = self.executor.execute(out)
        work = batch_work(out)
        d, hop = self.perf.stage_time(work), self.perf.send_time(work.num_tokens)
        ready = now
        for s in range(self.perf.pp):
            start = max(ready, self.stage_free[s])
            self.stage_free[s] = start + d
            self.stage_busy[s] += d
            ready = start + d + (hop if s < self.perf.pp - 1 else 0.0)
        return ready, engine, out, result

    def _fill(self, now: float, in_flight: deque, per_engine: list[int]) -> int:
        """Submit batches, schedulers in turn, while the pipeline and each scheduler have room."""
        submitted = 0
        n = len(self.engines)
        for k in range(n):
            e = (self._next_engine + k) % n
            sched = self.engines[e]
            while (len(in_flight) < self.max_in_flight and per_engine[e] < self.in_flight_per_engine
                   and sched.has_unfinished_requests()):
                batch = self._submit(e, now)
                if batch is None:
                    break
                in_flight.append(batch)
                per_engine[e] += 1
                submitted += 1
                self._next_engine = (e + 1) % n
        return submitted

    def _unfinished(self) -> bool:
        return any(e.has_unfinished_requests() for e in self.engines)

    def run(self, requests: list[SimRequest]) -> PipelineRun:
        """Serve `requests` (arrival times honoured); returns when all have finished."""
        pending = deque(sorted(requests, key=lambda r: r.arrival_time))
        in_flight: deque = deque()  # (end time, scheduler, output, result) in submission order; stages are FIFO
        per_engine = [0] * len(self.engines)
        finished = output_tokens = batches = 0
        while pending or in_flight or self._unfinished():
            now = self.clock.now()
            while pending and pending[0].arrival_time <= now:
                self._add(pending.popleft(), now)
            batches += self._fill(now, in_flight, per_engine)
            if in_flight:
                end, e, out, result = in_flight.popleft()
                if pending and pending[0].arrival_time < end:
                    in_flight.appendleft((end, e, out, result))  # an arrival comes first
                    self.clock.advance_to(pending[0].arrival_time)
                    continue
                self.clock.advance_to(max(end, now))
                per_engine[e] -= 1
                for req in self.engines[e].update(out, result):
                    finished += 1
                    output_tokens += req.num_output_tokens
            elif pending:
                self.clock.advance_to(max(pending[0].arrival_time, now))
            elif self._unfinished():
                raise RuntimeError("the scheduler stalled with requests left and nothing in flight")
        return PipelineRun(self.clock.now(), finished, output_tokens, batches,
                           sum(e.num_preemptions_total for e in self.engines), list(self.stage_busy),
                           list(self.batch_seqs))
