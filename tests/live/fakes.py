"""Test-only controllers over the pure routers, for driver tests that must not depend on a strategy.

They follow the controller contract of `ecoserve.cluster.events`: an `InstanceLost` re-routes the
requests that were dispatched there (the driver has already ended those that streamed tokens).
"""
from __future__ import annotations

from collections import Counter

from ecoserve.cluster import events as ev
from ecoserve.cluster.baselines import FuDGRouter, NoDGRouter
from ecoserve.cluster.topology import Topology

STAGING = ev.STAGING


class _FakeSurface:
    """The parts of the controller surface the driver reads besides `handle`: a fixed topology, no mitosis."""

    has_windows = False
    setups: dict[int, ev.InstanceSetup] = {}
    roles: dict[int, str]
    sent: Counter

    def topology(self) -> Topology:
        return Topology(self.roles)

    def summary(self) -> dict:
        return {"num_dispatched": dict(self.sent)}

    def scale_by_hand(self, macro: int, delta: int) -> list:
        raise ValueError("this cluster has no mitosis")

    def _count(self, acts: list) -> list:
        self.sent.update(a.instance_id for a in acts if isinstance(a, ev.Dispatch))
        return acts


class FakeNoDG(_FakeSurface):
    def __init__(self, instances: list[int], status_of) -> None:
        self.roles = {i: "both" for i in instances}
        self.sent = Counter()
        self.router = NoDGRouter(list(instances))
        self.status_of = status_of
        self.arrivals: dict[str, ev.RequestArrived] = {}
        self.where: dict[str, int] = {}
        self.events: list = []

    def start(self) -> list:
        return []

    def _route(self, e: ev.RequestArrived) -> list:
        iid = self.router.route(self.status_of)
        self.where[e.request_id] = iid
        return self._count([ev.Dispatch(e.request_id, iid, e.max_tokens)])

    def handle(self, e) -> list:
        self.events.append(e)
        if isinstance(e, ev.RequestArrived):
            self.arrivals[e.request_id] = e
            return self._route(e)
        if isinstance(e, (ev.RequestFinished, ev.RequestAborted)):
            self.arrivals.pop(e.request_id, None)
            self.where.pop(e.request_id, None)
        if isinstance(e, ev.InstanceLost):
            self.router.instances.remove(e.instance_id)
            acts = []
            for rid in [r for r, i in self.where.items() if i == e.instance_id]:
                acts += self._route(self.arrivals[rid])
            return acts
        return []


class FakeFuDG(_FakeSurface):
    """Prefill on the first `num_prefill` instances, KV to STAGING, decode on the one with most free KV."""

    def __init__(self, num_prefill: int, num_decode: int, status_of, direct: bool = False) -> None:
        n = num_prefill + num_decode
        self.roles = {i: "prefill" if i < num_prefill else "decode" for i in range(n)}
        self.sent = Counter()
        self.router = FuDGRouter(list(range(num_prefill)), list(range(num_prefill, n)))
        self.status_of = status_of
        self.direct = direct  # TransferKV straight to the decode instance instead of STAGING
        self.arrivals: dict[str, ev.RequestArrived] = {}
        self.events: list = []

    def start(self) -> list:
        return []

    def handle(self, e) -> list:
        self.events.append(e)
        if isinstance(e, ev.RequestArrived):
            self.arrivals[e.request_id] = e
            return self._count([ev.Dispatch(e.request_id, self.router.route_prefill(self.status_of), 1)])
        if isinstance(e, ev.PrefillDone):
            dst = self.router.route_decode(self.status_of, 1) if self.direct else STAGING
            return [ev.TransferKV(e.request_id, e.instance_id, dst, e.num_tokens, 0)]
        if isinstance(e, ev.TransferDone):
            req = self.arrivals[e.request_id]
            dst = e.dst if e.dst != STAGING else self.router.route_decode(self.status_of, 1)
            return self._count([ev.Dispatch(e.request_id, dst, req.max_tokens - 1, imported_tokens=req.prompt_len)])
        if isinstance(e, (ev.RequestFinished, ev.RequestAborted)):
            self.arrivals.pop(e.request_id, None)
        return []
