"""The simulator's driver of the cluster controllers: simulated instances, KV links, metrics.

A strategy is a controller from `ecoserve.cluster` (the same one the live frontend runs);
`ClusterSim` turns its actions into simulated work and feeds back what happened as events. It
holds no strategy logic: where requests go, windows, holds and mitosis are all decided above.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ecoserve.clock import VirtualClock
from ecoserve.cluster.events import (STAGING, CloseWindow, Dispatch, FinishRequest, HoldOutput, InstanceReported,
                                     OpenWindow, PrefillDone, ReleaseOutput, RequestArrived, RequestFinished,
                                     SetTimer, TimerFired, TransferDone, TransferKV)
from ecoserve.cluster.profile import PROFILE_TOKENS
from ecoserve.cluster.status import InstanceStatus
from ecoserve.cluster.strategies import STRATEGIES, ControllerOptions, build_controller
from ecoserve.cluster.timeline import TimelineRecorder
from ecoserve.config import SchedulerConfig
from ecoserve.sim.engine import EventLoop
from ecoserve.sim.events import Event, LinkCompletion, RequestArrival, StepEnd, Timer
from ecoserve.sim.hardware import gpu as get_gpu, link as get_link
from ecoserve.sim.instance import SimInstance
from ecoserve.sim.lora import AdapterCache, LoRASimConfig
from ecoserve.sim.metrics import RequestRecord
from ecoserve.sim.models import model as get_model
from ecoserve.sim.network import LinkQueue
from ecoserve.sim.perf import make_perf
from ecoserve.sim.speculation import SpeculatingExecutor, SpeculationModel
from ecoserve.sim.profiling import measured_prefill_table
from ecoserve.sim.workload import SimRequest

__all__ = ["STRATEGIES", "ClusterSim", "ClusterSpec", "SimResult", "build"]


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
    profile_tokens: tuple[int, ...] = PROFILE_TOKENS  # lengths the router's start-up profile is timed at
    perf_knobs: dict = field(default_factory=dict)
    speculation: SpeculationModel | None = None  # speculative decoding on every instance's decodes
    lora: LoRASimConfig | None = None  # requests with a `lora_name` run through adapters (sim/lora.py)

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
    def __init__(self, spec: ClusterSpec, strategy: str, ttft_slo: float, tpot_slo: float, **options) -> None:
        self.spec = spec
        self.ttft_slo, self.tpot_slo = ttft_slo, tpot_slo
        self.clock = VirtualClock()
        self.loop = EventLoop(self.clock)
        self.perf = spec.perf()
        self.model = get_model(spec.model)
        cap = getattr(self.perf, "kv_capacity_tokens", None) or 100_000
        self.num_blocks = max(cap // spec.block_size, 1)
        opts = ControllerOptions(ttft_slo, tpot_slo, num_instances=spec.num_instances,
                                 max_num_batched_tokens=spec.max_num_batched_tokens, chunk_size=spec.chunk_size,
                                 kv_bytes_per_token=self.model.kv_bytes_per_token, **options)
        measured = measured_prefill_table(self.perf, spec.max_num_batched_tokens,  # what a live instance reports
                                          token_counts=spec.profile_tokens)
        self.controller = build_controller(strategy, opts, self.clock, measured.seconds, statuses=self.status_of)
        self.instances: list[SimInstance] = []
        for iid in sorted(self.controller.setups):
            setup = self.controller.setups[iid]
            cfg = SchedulerConfig(policy=setup.policy, max_num_seqs=spec.max_num_seqs,
                                  max_num_batched_tokens=setup.max_num_batched_tokens or spec.max_num_batched_tokens)
            adapters = AdapterCache(self.model, spec.lora) if spec.lora is not None else None
            executor = SpeculatingExecutor(self.perf, spec.speculation, adapters=adapters) if spec.speculation \
                else None
            self.instances.append(SimInstance(iid, self.perf, self.clock, cfg, self.num_blocks, spec.block_size,
                                              executor=executor, adapters=adapters))
        self.timeline = TimelineRecorder([i.instance_id for i in self.instances])  # what `--plot` draws
        for inst in self.instances:
            self.timeline.phase(0.0, inst.instance_id, "idle")
        intra = get_gpu(spec.gpu).intra_node_link
        self.links = {i: LinkQueue(get_link(intra if s.kv_path == "intra_node" else spec.network))
                      for i, s in self.controller.setups.items() if s.role == "prefill"}
        self._link_next: dict[int, float | None] = {i: None for i in self.links}
        self._nbytes: dict[str, float] = {}
        self.requests: dict[str, SimRequest] = {}
        self.remaining: dict[str, int] = {}  # output tokens a request still has to produce (over its legs)
        self.first_token: dict[str, float] = {}
        self.records: list[RequestRecord] = []
        self.failed: dict[str, str] = {}
        self.window_opens: list[tuple[float, int]] = []
        self.first_delivery: dict[str, float] = {}  # when a request's first token reached its client
        self._held: dict[int, set[str]] = {}  # instance -> requests whose first token it holds back
        self._active = True

    def status_of(self, iid: int) -> InstanceStatus:
        return self.instances[iid].status()

    # ---- actions -> simulated work ---------------------------------------------------------------
    def apply(self, actions) -> list[Event]:
        events: list[Event] = []
        for a in actions:
            t = type(a)
            if t is Dispatch:
                inst = self.instances[a.instance_id]
                req = self.requests[a.request_id]
                inst.add(a.request_id, req.input_len + 1 if a.imported_tokens else req.input_len, a.max_tokens,
                         a.imported_tokens, req.lora_name)
                self.timeline.routed(self.clock.now(), a.instance_id)
                events.extend(self.kick(inst))
            elif t is TransferKV:
                self._nbytes[a.request_id] = a.nbytes
                self.links[a.src].start(a.request_id, a.nbytes, self.clock.now())
            elif t is OpenWindow:
                inst = self.instances[a.instance_id]
                inst.open_window()
                self.window_opens.append((self.clock.now(), a.instance_id))
                self.timeline.window_opened(self.clock.now(), a.instance_id)
                events.extend(self.kick(inst))
            elif t is CloseWindow:
                self.instances[a.instance_id].close_window()
                self.timeline.window_closed(self.clock.now(), a.instance_id)
            elif t is HoldOutput:
                self._held.setdefault(a.instance_id, set())
            elif t is ReleaseOutput:
                self._release(a.instance_id)
            elif t is SetTimer:
                if self._active:
                    events.append(Timer(max(a.time, self.clock.now()), a.name))
            elif t is FinishRequest:
                self.failed[a.request_id] = a.reason
                self.requests.pop(a.request_id, None)
        return events

    def kick(self, inst: SimInstance) -> list[Event]:
        end = inst.try_start()
        if end is not None:
            self.timeline.phase(self.clock.now(), inst.instance_id, inst.sched.phase)
        elif not inst.busy:
            self.timeline.phase(self.clock.now(), inst.instance_id, "idle")
        return [StepEnd(end, inst)] if end is not None else []

    # ---- simulator events -> controller events ---------------------------------------------------
    def on_arrival(self, req: SimRequest) -> list[Event]:
        self.requests[req.request_id] = req
        self.remaining[req.request_id] = req.output_len
        return self.apply(self.controller.handle(
            RequestArrived(req.request_id, req.input_len, req.output_len, req.arrival_time, req.lora_name)))

    def on_step_end(self, inst: SimInstance) -> list[Event]:
        first, finished = inst.finish_step()
        now = self.clock.now()
        iid = inst.instance_id
        for r in first:
            self.first_token.setdefault(r.request_id, now)
            if iid in self._held:
                self._held[iid].add(r.request_id)
            else:
                self.first_delivery.setdefault(r.request_id, now)
        events: list[Event] = []
        for r in finished:
            rid = r.request_id
            left = self.remaining[rid] - r.num_output_tokens
            self.remaining[rid] = left
            ds = inst.decode_start.pop(rid, None)
            if left > 0:  # FuDG: the prefill leg is done, the decode leg follows elsewhere
                events.extend(self.apply(self.controller.handle(PrefillDone(rid, iid, r.num_prompt_tokens))))
            else:
                events.extend(self.record(rid, iid, ds))
        events.extend(self.apply(self.controller.handle(InstanceReported(iid))))
        if iid in self.links:
            events.extend(self._schedule_link(iid))
        events.extend(self.kick(inst))
        return events

    def on_link(self, lid: int) -> list[Event]:
        self._link_next[lid] = None
        events: list[Event] = []
        for rid in self.links[lid].advance_to(self.clock.now()):
            done = TransferDone(rid, lid, STAGING, self._nbytes.pop(rid))
            events.extend(self.apply(self.controller.handle(done)))
        return events + self._schedule_link(lid)

    def _schedule_link(self, lid: int) -> list[Event]:
        t = self.links[lid].next_completion()
        if t is None or t == self._link_next[lid]:
            return []
        self._link_next[lid] = t
        return [LinkCompletion(max(t, self.clock.now()), lid)]

    def on_timer(self, name: str) -> list[Event]:
        return self.apply(self.controller.handle(TimerFired(name))) if self._active else []

    # ---- output hold and metrics -----------------------------------------------------------------
    def _release(self, iid: int) -> None:
        """Flush what the instance held: its clients see those tokens now."""
        now = self.clock.now()
        for rid in self._held.pop(iid, ()):
            self.first_delivery.setdefault(rid, now)

    def record(self, rid: str, iid: int, decode_start: float | None) -> list[Event]:
        """The request's last token: the client gets it at once, held or not (a finished request is flushed)."""
        req = self.requests.pop(rid)
        self.remaining.pop(rid, None)
        now = self.clock.now()
        ft = self.first_token.pop(rid, now)
        self._held.get(iid, set()).discard(rid)
        delivered = self.first_delivery.pop(rid, now)
        ds = decode_start if decode_start is not None else ft
        rec = RequestRecord(rid, req.arrival_time, ft, ds, now, req.input_len, req.output_len,
                            first_delivery=delivered, last_delivery=now)
        self.records.append(rec)
        return self.apply(self.controller.handle(RequestFinished(rid, iid, rec.ttft)))

    # ---- running --------------------------------------------------------------------------
    def run(self, workload: list[SimRequest], horizon: float | None = None, progress: bool = False) -> SimResult:
        """Simulate until every request finishes or `horizon` seconds after the last arrival."""
        last = max((r.arrival_time for r in workload), default=0.0)
        until = last + (horizon if horizon is not None else max(120.0, 20 * self.ttft_slo))
        self._active = True
        self.loop.push(RequestArrival(r.arrival_time, r) for r in workload)
        self.loop.push(self.apply(self.controller.start()))
        bar = None
        if progress:
            from tqdm import tqdm
            bar = tqdm(total=len(workload), unit="req", desc=type(self.controller).__name__, mininterval=1.0)
        done_before = 0
        total = len(workload)

        def on_event(_e) -> None:
            nonlocal done_before
            n = len(self.records) + len(self.failed)
            if bar is not None and n != done_before:
                bar.update(n - done_before)
                done_before = n
            if n >= total:
                self._active = False

        self.loop.run(self, until=until, progress=on_event)
        if bar is not None:
            bar.close()
        return SimResult(self.records, total, self.clock.now(), self.loop.num_handled, self.summary())

    def instance_summaries(self, sent: dict[int, int]) -> list[dict]:
        """Per instance: busy fraction, windows (null without router-commanded windows), share of dispatches."""
        now = max(self.clock.now(), 1e-9)
        windows = self.controller.has_windows
        total = max(sum(sent.values()), 1)
        return [{"id": i.instance_id, "busy_fraction": i.busy_time / now,
                 "num_windows": i.sched.window.num_windows if windows else None,
                 "mean_window_s": i.sched.window.mean_open_s() if windows else None,
                 "routed_fraction": sent.get(i.instance_id, 0) / total} for i in self.instances]

    def summary(self) -> dict:
        ctrl = self.controller.summary()
        out = {"instances": self.instance_summaries(ctrl["num_dispatched"]),
               "num_steps": sum(i.num_steps for i in self.instances)}
        if self.links:
            out["kv_transferred_gb"] = ctrl["kv_transferred_bytes"] / 1e9
        if "timeline" in ctrl:
            out["timeline"] = ctrl["timeline"]
        if self.failed:
            out["failed"] = dict(self.failed)
        if self.spec.speculation:  # vLLM's counters, summed over instances
            execs = [i.executor for i in self.instances]
            drafts, accepted = sum(e.num_drafts for e in execs), sum(e.num_accepted_tokens for e in execs)
            out["spec_decode"] = {"num_drafts": drafts, "num_draft_tokens": sum(e.num_draft_tokens for e in execs),
                                  "num_accepted_tokens": accepted,
                                  "acceptance_length": 1 + accepted / drafts if drafts else 1.0}
        caches = [i.executor.adapters for i in self.instances if i.executor.adapters is not None]
        if caches:
            out["lora_loads"] = sum(c.loads for c in caches)
            out["lora_evictions"] = sum(c.evictions for c in caches)
        return out


def build(name: str, spec: ClusterSpec, ttft_slo: float, tpot_slo: float, **options) -> ClusterSim:
    """A simulated cluster running strategy `name`; `options` are `ControllerOptions` fields.

    Lists are accepted for `macro_sizes` and `pd`.
    """
    for key in ("macro_sizes", "pd"):
        if options.get(key) is not None:
            options[key] = tuple(options[key])
    return ClusterSim(spec, name, ttft_slo, tpot_slo, **options)
