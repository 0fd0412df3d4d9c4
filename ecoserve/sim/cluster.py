"""Cluster simulations: instances driven by the live scheduler, routed by the cluster policies.

`ClusterSim` holds the event plumbing and the metrics; subclasses (NoDG, FuDG, PaDG) only say where
requests go. Everything routes through `ecoserve.cluster` and `ecoserve.sched` unchanged.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ecoserve.clock import VirtualClock
from ecoserve.config import SchedulerConfig
from ecoserve.sim.engine import EventLoop
from ecoserve.sim.events import Event, RequestArrival, StepEnd
from ecoserve.sim.instance import SimInstance
from ecoserve.sim.metrics import RequestRecord
from ecoserve.sim.models import model as get_model
from ecoserve.sim.perf import make_perf
from ecoserve.sim.workload import SimRequest


@dataclass
class ClusterSpec:
    model: str = "codellama-34b"
    gpu: str = "L20"
    tp: int = 4
    pp: int = 1
    num_instances: int = 8
    network: str = "10gbe"  # between nodes (FuDG inter-node KV); intra-node is the GPU's link
    profile: str | None = None  # a tokens,ms CSV instead of the roofline
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 4096  # separate batching (vLLM, EcoServe instance, FuDG prefill)
    chunk_size: int = 512  # Sarathi's token budget per hybrid step
    perf_knobs: dict = field(default_factory=dict)

    def perf(self):
        return make_perf(self.model, self.gpu, tp=self.tp, pp=self.pp, profile=self.profile, **self.perf_knobs)

    @property
    def num_gpus(self) -> int:
        return self.num_instances * self.tp * self.pp


@dataclass
class SimResult:
    records: list[RequestRecord]
    num_submitted: int
    sim_time: float
    num_events: int
    extra: dict = field(default_factory=dict)


class ClusterSim:
    def __init__(self, spec: ClusterSpec, ttft_slo: float, tpot_slo: float) -> None:
        self.spec = spec
        self.ttft_slo, self.tpot_slo = ttft_slo, tpot_slo
        self.clock = VirtualClock()
        self.loop = EventLoop(self.clock)
        self.perf = spec.perf()
        self.model = get_model(spec.model)
        cap = getattr(self.perf, "kv_capacity_tokens", None) or 100_000
        self.num_blocks = max(cap // spec.block_size, 1)
        self.instances: list[SimInstance] = []
        self.requests: dict[str, SimRequest] = {}
        self.first_token: dict[str, float] = {}
        self.records: list[RequestRecord] = []
        self.ticks: dict[str, float] = {}

    # ---- building -------------------------------------------------------------------------
    def new_instance(self, policy: str, max_num_batched_tokens: int | None = None) -> SimInstance:
        cfg = SchedulerConfig(policy=policy, max_num_batched_tokens=max_num_batched_tokens
                              or self.spec.max_num_batched_tokens, max_num_seqs=self.spec.max_num_seqs)
        inst = SimInstance(len(self.instances), self.perf, self.clock, cfg, self.num_blocks, self.spec.block_size)
        inst.on_first_token = self._on_first_token
        inst.on_finish = self._on_finish
        self.instances.append(inst)
        return inst

    def status_of(self, iid: int):
        return self.instances[iid].status()

    # ---- events ---------------------------------------------------------------------------
    def dispatch(self, inst: SimInstance, req: SimRequest, max_tokens: int | None = None, imported: int = 0,
                 prompt_len: int | None = None) -> list[Event]:
        inst.add(req.request_id, prompt_len or req.input_len, max_tokens or req.output_len, imported)
        return self.kick(inst)

    def kick(self, inst: SimInstance) -> list[Event]:
        end = inst.try_start()
        return [StepEnd(end, inst)] if end is not None else []

    def on_arrival(self, req: SimRequest) -> list[Event]:
        raise NotImplementedError

    def on_step_end(self, inst: SimInstance) -> list[Event]:
        inst.finish_step()
        events = self.after_step(inst)
        events.extend(self.kick(inst))
        return events

    def after_step(self, inst: SimInstance) -> list[Event]:
        return []

    def on_tick(self, name: str) -> list[Event]:
        return []

    def keep_ticking(self, name: str) -> bool:
        return self._active

    def on_transfer_tick(self, link_id) -> list[Event]:
        return []

    # ---- lifecycle callbacks ----------------------------------------------------------------
    def _on_first_token(self, inst: SimInstance, r) -> None:
        self.first_token.setdefault(r.request_id, self.clock.now())

    def _on_finish(self, inst: SimInstance, r) -> None:
        self.record(r.request_id, inst.decode_start.get(r.request_id))

    def record(self, rid: str, decode_start: float | None) -> None:
        req = self.requests.pop(rid)
        now = self.clock.now()
        ft = self.first_token.pop(rid, now)
        self.records.append(RequestRecord(rid, req.arrival_time, ft, decode_start if decode_start is not None else ft,
                                          now, req.input_len, req.output_len))

    # ---- running --------------------------------------------------------------------------
    def run(self, workload: list[SimRequest], horizon: float | None = None, progress: bool = False) -> SimResult:
        """Simulate until every request finishes or `horizon` seconds after the last arrival."""
        last = max((r.arrival_time for r in workload), default=0.0)
        until = last + (horizon if horizon is not None else max(120.0, 20 * self.ttft_slo))
        self._active = True
        self.loop.push(RequestArrival(r.arrival_time, r) for r in workload)
        for name, period in self.ticks.items():
            from ecoserve.sim.events import Tick
            self.loop.push(Tick(period, name, period))
        bar = None
        if progress:
            from tqdm import tqdm
            bar = tqdm(total=len(workload), unit="req", desc=type(self).__name__, mininterval=1.0)
        done_before = 0

        def on_event(_e) -> None:
            nonlocal done_before
            n = len(self.records)
            if n != done_before:
                bar.update(n - done_before)
                done_before = n
            if n >= len(workload):
                self._active = False

        def watch(_e) -> None:
            if len(self.records) >= len(workload):
                self._active = False

        self.loop.run(self, until=until, progress=on_event if bar else watch)
        if bar is not None:
            bar.close()
        return SimResult(self.records, len(workload), self.clock.now(), self.loop.num_handled, self.summary())

    def summary(self) -> dict:
        busy = [i.busy_time / max(self.clock.now(), 1e-9) for i in self.instances]
        return {"instance_busy_frac": busy, "num_steps": sum(i.num_steps for i in self.instances)}
