"""Serving strategies over the simulated cluster, registered by name.

- vllm      NoDG, separate batching with prefill priority (`prefill_first`), round robin.
- sarathi   NoDG, decode-first hybrid batches with chunked prefill (`chunked`), round robin.
- distserve FuDG intra-node: prefill and decode instances paired in a node, KV over PCIe.
- mooncake  FuDG inter-node: KV over the node network; `pd` sets the P:D split (swept by experiments).
- ecoserve  PaDG: `temporal` instances in macro instances, Algorithm 1 + rolling activation,
            optional mitosis.
"""
from __future__ import annotations

from collections import deque

from ecoserve.cluster.baselines import FuDGRouter, NoDGRouter
from ecoserve.cluster.mitosis import MitosisConfig, MitosisController
from ecoserve.cluster.overall import OverallScheduler
from ecoserve.cluster.router import MacroInstance, RouterConfig
from ecoserve.sim.cluster import ClusterSim, ClusterSpec
from ecoserve.sim.events import Event, TransferDone
from ecoserve.sim.hardware import link as get_link
from ecoserve.sim.network import LinkQueue
from ecoserve.sim.registry import Registry
from ecoserve.sim.workload import SimRequest

STRATEGIES: Registry = Registry("strategy")


class NoDGSim(ClusterSim):
    def __init__(self, spec: ClusterSpec, ttft_slo: float, tpot_slo: float, policy: str = "prefill_first",
                 balance: str = "round_robin") -> None:
        super().__init__(spec, ttft_slo, tpot_slo)
        budget = spec.chunk_size if policy == "chunked" else None
        for _ in range(spec.num_instances):
            self.new_instance(policy, budget)
        self.router = NoDGRouter(list(range(spec.num_instances)), balance)

    def on_arrival(self, req: SimRequest) -> list[Event]:
        self.requests[req.request_id] = req
        return self.dispatch(self.instances[self.router.route(self.status_of)], req)


class FuDGSim(ClusterSim):
    """Prefill instances produce the first token, ship the prompt's KV, decode instances go on."""

    def __init__(self, spec: ClusterSpec, ttft_slo: float, tpot_slo: float, num_prefill: int | None = None,
                 kv_link: str | None = None) -> None:
        super().__init__(spec, ttft_slo, tpot_slo)
        n_p = num_prefill if num_prefill is not None else spec.num_instances // 2
        if not 1 <= n_p < spec.num_instances:
            raise ValueError(f"num_prefill must be in [1, {spec.num_instances - 1}], got {n_p}")
        for k in range(spec.num_instances):
            self.new_instance("prefill_first", None if k < n_p else 1 << 15)
        self.router = FuDGRouter(list(range(n_p)), list(range(n_p, spec.num_instances)))
        lk = get_link(kv_link or spec.network)
        self.links = {i: LinkQueue(lk) for i in range(n_p)}  # each prefill instance's outgoing link
        self._link_next: dict[int, float | None] = {i: None for i in range(n_p)}
        self.bridge: deque[str] = deque()  # transferred, waiting for decode-side KV
        self.kv_bytes = self.model.kv_bytes_per_token
        self.transferred_bytes = 0.0

    def on_arrival(self, req: SimRequest) -> list[Event]:
        self.requests[req.request_id] = req
        return self.dispatch(self.instances[self.router.route_prefill(self.status_of)], req, max_tokens=1)

    def _on_finish(self, inst, r) -> None:
        rid = r.request_id
        if inst.instance_id in self.links and self.requests[rid].output_len > 1:
            nbytes = r.num_prompt_tokens * self.kv_bytes
            self.transferred_bytes += nbytes
            self.links[inst.instance_id].start(rid, nbytes, self.clock.now())
            self._pending_link = inst.instance_id
            return
        self.record(rid, inst.decode_start.get(rid))

    def after_step(self, inst) -> list[Event]:
        events = []
        if inst.instance_id in self.links:
            events.extend(self._schedule_link(inst.instance_id))
        else:
            events.extend(self._drain_bridge())
        return events

    def _schedule_link(self, lid: int) -> list[Event]:
        t = self.links[lid].next_completion()
        if t is None or t == self._link_next[lid]:
            return []
        self._link_next[lid] = t
        return [TransferDone(max(t, self.clock.now()), lid)]

    def on_transfer_tick(self, lid: int) -> list[Event]:
        now = self.clock.now()
        self._link_next[lid] = None
        self.bridge.extend(self.links[lid].advance_to(now))
        return self._drain_bridge() + self._schedule_link(lid)

    def _drain_bridge(self) -> list[Event]:
        events = []
        while self.bridge:
            rid = self.bridge[0]
            req = self.requests[rid]
            iid = self.router.route_decode(self.status_of, req.input_len + req.output_len)
            if iid is None:
                break
            self.bridge.popleft()
            inst = self.instances[iid]
            inst.add(rid, req.input_len + 1, req.output_len - 1, imported_tokens=req.input_len)
            events.extend(self.kick(inst))
        return events

    def summary(self) -> dict:
        return {**super().summary(), "kv_transferred_gb": self.transferred_bytes / 1e9}


class PaDGSim(ClusterSim):
    """EcoServe: temporal instances grouped into macro instances; optional mitosis scaling."""

    def __init__(self, spec: ClusterSpec, ttft_slo: float, tpot_slo: float, router: dict | None = None,
                 macro_sizes: list[int] | None = None, mitosis: dict | None = None,
                 total_instances: int | None = None, mitosis_period: float = 5.0, ttft_window: float = 30.0) -> None:
        super().__init__(spec, ttft_slo, tpot_slo)
        total = total_instances or spec.num_instances
        for _ in range(total):
            self.new_instance("temporal")
        self.router_config = RouterConfig(ttft_slo, tpot_slo, **(router or {}))
        sizes = macro_sizes or [spec.num_instances]
        self.macros: dict[int, MacroInstance] = {}
        start = 0
        for m, n in enumerate(sizes):
            self.macros[m] = self._macro(m, list(range(start, start + n)))
            start += n
        self.overall = OverallScheduler(self.macros)
        self.macro_of: dict[int, int] = {i: m for m, mac in self.macros.items() for i in mac.instances}
        self.controller = None
        if mitosis is not None:
            self.controller = MitosisController(MitosisConfig(ttft_slo=ttft_slo, **mitosis),
                                                {m: list(mac.instances) for m, mac in self.macros.items()},
                                                free=list(range(start, total)))
            self.ticks["mitosis"] = mitosis_period
        if self.router_config.mode == "fixed_interval":
            self.ticks["route"] = self.router_config.interval_frac * ttft_slo
        self.ttft_window = ttft_window
        self._recent: deque[tuple[float, int, float]] = deque()  # (time, macro, ttft)
        self.timeline: list[dict] = []
        self._macro_of_request: dict[str, int] = {}

    def _macro(self, m: int, ids: list[int]) -> MacroInstance:
        return MacroInstance(ids, self.perf.predicted_prefill_time, self.router_config, macro_id=m)

    def _send(self, pairs: list[tuple[str, int]]) -> list[Event]:
        events = []
        for rid, iid in pairs:
            events.extend(self.dispatch(self.instances[iid], self.requests[rid]))
        return events

    def on_arrival(self, req: SimRequest) -> list[Event]:
        self.requests[req.request_id] = req
        mac = self.overall.pick()
        return self._send(mac.submit(req.request_id, req.input_len, self.status_of, self.clock.now()))

    def after_step(self, inst) -> list[Event]:
        events = []
        now = self.clock.now()
        for mac in self.macros.values():
            if mac.pending:
                events.extend(self._send(mac.retry(self.status_of, now)))
        if self.controller is not None and inst.instance_id in self.controller.draining \
                and inst.num_unfinished == 0 and not inst.busy:
            self.controller.release(inst.instance_id)
        return events

    def record(self, rid: str, decode_start: float | None) -> None:
        super().record(rid, decode_start)
        if self.controller is not None:
            r = self.records[-1]
            self._recent.append((self.clock.now(), self._macro_of_request.pop(rid, 0), r.ttft))

    def dispatch(self, inst, req, **kw) -> list[Event]:
        if self.controller is not None:
            self._macro_of_request[req.request_id] = self.macro_of.get(inst.instance_id, 0)
        return super().dispatch(inst, req, **kw)

    def on_tick(self, name: str) -> list[Event]:
        now = self.clock.now()
        if name == "route":
            events = []
            for mac in self.macros.values():
                events.extend(self._send(mac.interval_tick(self.status_of, now)))
            return events
        return self._mitosis(now)

    def _mitosis(self, now: float) -> list[Event]:
        while self._recent and self._recent[0][0] < now - self.ttft_window:
            self._recent.popleft()
        ttft: dict[int, list[float]] = {m: [] for m in self.macros}
        for _, m, v in self._recent:
            ttft.setdefault(m, []).append(v)
        for m, mac in self.macros.items():  # requests stuck in the router count with their age
            ttft[m].extend(now - self.requests[p.request_id].arrival_time for p in mac.pending)
        mean_ttft = {m: sum(v) / len(v) for m, v in ttft.items() if v}
        saved = {}
        for m, mac in self.macros.items():
            vals = [s for s in (mac.saved_tpot(self.status_of(i), now) for i in mac.instances) if s is not None]
            saved[m] = sum(vals) / len(vals) if vals else None
        for a in self.controller.step(now, mean_ttft, saved):
            self._apply(a)
        for iid in list(self.controller.draining):
            if self.instances[iid].num_unfinished == 0 and not self.instances[iid].busy:
                self.controller.release(iid)
        c = self.controller.count()
        self.timeline.append({"time": now, **c, "sizes": sorted(len(v) for v in self.controller.macros.values())})
        events = []
        for mac in self.macros.values():
            events.extend(self._send(mac.retry(self.status_of, now)))
        return events

    def _apply(self, a) -> None:
        if a.kind == "add":
            self.macros[a.macro].add_instance(a.instances[0])
            self.macro_of[a.instances[0]] = a.macro
        elif a.kind == "split":
            new_id, moved = a.other, a.instances[1:]
            for iid in moved:
                self.macros[a.macro].remove_instance(iid)
            self.macros[new_id] = self._macro(new_id, list(a.instances))
            for iid in a.instances:
                self.macro_of[iid] = new_id
        elif a.kind == "drain":
            self.macros[a.macro].remove_instance(a.instances[0])
            self.macro_of.pop(a.instances[0], None)
        elif a.kind == "merge":
            gone = self.macros.pop(a.other)
            for iid in gone.instances:
                self.macros[a.macro].add_instance(iid)
                self.macro_of[iid] = a.macro
            self.macros[a.macro].pending.extend(gone.pending)

    def summary(self) -> dict:
        out = super().summary()
        if self.controller is not None:
            out["timeline"] = self.timeline
        return out


def _vllm(spec, ttft, tpot, **kw):
    return NoDGSim(spec, ttft, tpot, policy="prefill_first", **kw)


def _sarathi(spec, ttft, tpot, **kw):
    return NoDGSim(spec, ttft, tpot, policy="chunked", **kw)


def _distserve(spec, ttft, tpot, pd: tuple[int, int] | None = None, **kw):
    n_p = pd[0] if pd else spec.num_instances // 2
    from ecoserve.sim.hardware import gpu
    return FuDGSim(spec, ttft, tpot, num_prefill=n_p, kv_link=gpu(spec.gpu).intra_node_link, **kw)


def _mooncake(spec, ttft, tpot, pd: tuple[int, int] | None = None, **kw):
    n_p = pd[0] if pd else spec.num_instances // 2
    return FuDGSim(spec, ttft, tpot, num_prefill=n_p, kv_link=spec.network, **kw)


def _ecoserve(spec, ttft, tpot, **kw):
    return PaDGSim(spec, ttft, tpot, **kw)


STRATEGIES.add("vllm", _vllm)
STRATEGIES.add("sarathi", _sarathi)
STRATEGIES.add("distserve", _distserve)
STRATEGIES.add("mooncake", _mooncake)
STRATEGIES.add("ecoserve", _ecoserve)


def build(name: str, spec: ClusterSpec, ttft_slo: float, tpot_slo: float, **kw) -> ClusterSim:
    return STRATEGIES.get(name)(spec, ttft_slo, tpot_slo, **kw)
