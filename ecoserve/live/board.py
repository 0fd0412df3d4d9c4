"""The frontend's picture of its instances: who they are, how fresh their status is, what was sent since.

An instance's `Status` reflects the dispatches it had seen (`last_dispatch_seq`); the board
overlays the ones sent after it, so a controller never routes on a view that forgot its own
recent decisions. Times are rebased onto the frontend's clock (the frontend stamps routing and
first-token times itself), so instances on other nodes may run their own clocks.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal

import msgspec

from ecoserve.cluster.status import InstanceStatus, RequestState
from ecoserve.cluster.topology import Topology
from ecoserve.live.messages import Ready
from ecoserve.states import InstanceState, Phase, Role

HandleState = Literal["starting", "ready", "lost"]  # what the driver itself knows; the rest is the topology's
# upper bounds (seconds) of /metrics' window length histogram: a window holds one batch of prompts, so
# from tens of milliseconds (a short prompt) to minutes (an instance left in its window while idle)
WINDOW_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


@dataclass
class WindowLengths:
    """The lengths of an instance's closed prefill windows, bucketed as a Prometheus histogram
    (kept as counts, not samples: a long run closes windows without end)."""

    counts: list[int] = field(default_factory=lambda: [0] * (len(WINDOW_BUCKETS) + 1))  # the last: > every bound
    total_s: float = 0.0

    def observe(self, length_s: float) -> None:
        self.counts[next((i for i, b in enumerate(WINDOW_BUCKETS) if length_s <= b), len(WINDOW_BUCKETS))] += 1
        self.total_s += length_s

    def cumulative(self) -> list[tuple[str, int]]:
        """(`le`, count at or below it) per bound, then `+Inf`, as `HistogramMetricFamily` takes them."""
        out, seen = [], 0
        for bound, n in zip([*map(str, WINDOW_BUCKETS), "+Inf"], self.counts):
            seen += n
            out.append((bound, seen))
        return out


@dataclass
class InstanceHandle:
    instance_id: int
    identity: bytes | None = None  # its ZeroMQ routing id, once connected
    ready: Ready | None = None
    state: HandleState = "starting"
    pid: int | None = None
    host: str | None = None
    last_heard: float = 0.0
    status: InstanceStatus | None = None
    status_received: float = 0.0
    status_seq: int = 0
    dispatch_seq: int = 0
    unseen: dict[int, RequestState] = field(default_factory=dict)  # dispatch seq -> request sent since the status
    requests: set[str] = field(default_factory=set)  # requests the frontend has running here
    lost_reason: str | None = None
    num_windows: int = 0
    window_open: bool = False
    window_opened_at: float | None = None  # the frontend's clock, while `window_open`
    window_lengths: WindowLengths = field(default_factory=WindowLengths)
    held: bool = False  # output hold (reference mode)
    join_deadline: float = float("inf")  # a starting instance that has not joined by then is lost
    restarts: int = 0  # times the frontend started this slot's process again
    restart_pending: bool = False  # lost, and a restart is scheduled or under way
    lost_at: float | None = None  # when it was last lost (a lost slot with no restart leaves the board later)

    def restarted(self, pid: int | None, join_deadline: float) -> None:
        """A new process took this slot: forget the old connection and its status, keep the id and the counts."""
        self.identity, self.ready, self.pid, self.host = None, None, pid, None
        self.status, self.status_received, self.status_seq = None, 0.0, 0
        self.dispatch_seq, self.unseen, self.requests = 0, {}, set()
        self.window_open, self.window_opened_at, self.held = False, None, False
        self.state, self.lost_reason, self.lost_at = "starting", None, None
        self.join_deadline, self.restart_pending = join_deadline, False
        self.restarts += 1


@dataclass(frozen=True)
class InstanceView:
    """One instance as /cluster and /metrics show it: what the driver knows, placed in the controller's topology."""

    id: int
    pid: int | None
    host: str | None
    state: InstanceState
    role: Role | int | None  # macro id (PaDG), "prefill" / "decode" (FuDG), None (NoDG, outside any macro)
    phase: Phase | None
    status_age_s: float | None
    num_requests: int
    free_kv_tokens: int | None
    num_windows: int
    lost_reason: str | None
    num_dispatched: int
    engine: dict | None  # the engine settings the instance reported in its Ready
    restarts: int  # times the frontend restarted this slot's process
    window_open: bool  # the frontend opened its prefill window and has not closed it (never while lost)
    num_running: int | None  # as the instance last reported (None: no status yet)
    num_waiting: int | None
    loras: tuple[str, ...] = ()  # the LoRA adapters it holds, as it last reported


def view_of(h: InstanceHandle, topology: Topology | None, num_dispatched: int, now: float) -> InstanceView:
    """`topology` None: no controller yet, so no roles and no free or draining instances."""
    state: InstanceState = h.state
    role: Role | int | None = None
    if topology is not None:
        iid = h.instance_id
        if h.state == "ready" and iid in topology.draining:
            state = "draining"
        elif h.state == "ready" and iid in topology.free:
            state = "free"
        macro = topology.macro_of(iid)
        split_role = topology.roles.get(iid)
        role = macro if macro is not None else split_role if split_role in ("prefill", "decode") else None
    st = h.status
    return InstanceView(h.instance_id, h.pid, h.host, state, role, st.phase if st else None,
                        now - h.status_received if st else None, len(h.requests), st.free_kv_tokens if st else None,
                        h.num_windows, h.lost_reason, num_dispatched,
                        msgspec.to_builtins(h.ready.engine) if h.ready else None, h.restarts,
                        h.window_open and h.state != "lost",                        st.num_running if st else None, st.num_waiting if st else None,
                        st.loras if st else ())


def _rebase(st: InstanceStatus, offset: float, routed: dict[str, float], first: dict[str, float]) -> InstanceStatus:
    reqs = tuple(r._replace(routed_time=routed.get(r.request_id, r.routed_time + offset),
                            first_token_time=first.get(r.request_id, None if r.first_token_time is None
                                                       else r.first_token_time + offset))
                 for r in st.requests)
    return dataclasses.replace(st, time=st.time + offset, t_switch=st.t_switch + offset, requests=reqs)


class InstanceBoard:
    def __init__(self) -> None:
        self.instances: dict[int, InstanceHandle] = {}
        self.routed_at: dict[str, float] = {}  # request id -> when the frontend dispatched it (its clock)
        self.first_token_at: dict[str, float] = {}
        self._next_id = 0  # ids are never reused, also after a lost slot left the board

    def __getitem__(self, instance_id: int) -> InstanceHandle:
        return self.instances[instance_id]

    def add(self, handle: InstanceHandle) -> InstanceHandle:
        self.instances[handle.instance_id] = handle
        self._next_id = max(self._next_id, handle.instance_id + 1)
        return handle

    def remove(self, instance_id: int) -> None:
        """A lost slot that will not come back leaves the board (frames no longer scan it)."""
        self.instances.pop(instance_id, None)

    def by_identity(self, identity: bytes) -> InstanceHandle | None:
        for h in self.instances.values():
            if h.identity == identity and h.state != "lost":
                return h
        return None

    def next_id(self) -> int:
        return self._next_id

    def live(self) -> list[InstanceHandle]:
        return [h for h in self.instances.values() if h.state not in ("starting", "lost")]

    # ---- status ----------------------------------------------------------------------------
    def dispatched(self, h: InstanceHandle, request_id: str, prompt_len: int, now: float) -> int:
        h.dispatch_seq += 1
        h.unseen[h.dispatch_seq] = RequestState(request_id, now, prompt_len, None, 0)
        h.requests.add(request_id)
        self.routed_at[request_id] = now
        return h.dispatch_seq

    def reported(self, h: InstanceHandle, st: InstanceStatus, last_dispatch_seq: int, now: float) -> None:
        """A status arrived at `now`: times move onto our clock; dispatches it has seen leave the overlay."""
        h.status = _rebase(st, now - st.time, self.routed_at, self.first_token_at)
        h.status_received = now
        for seq in [s for s in h.unseen if s <= last_dispatch_seq]:
            del h.unseen[seq]

    def status_of(self, instance_id: int) -> InstanceStatus:
        """The last status plus the requests dispatched since (their prompts' KV counted as taken)."""
        h = self.instances[instance_id]
        st = h.status
        if st is None:
            total = h.ready.total_kv_tokens if h.ready else 0
            st = InstanceStatus(instance_id, h.status_received, "idle", h.status_received, (), total, total)
        if not h.unseen:
            return st
        known = {r.request_id for r in st.requests}
        extra = tuple(r for r in h.unseen.values() if r.request_id not in known)
        return dataclasses.replace(st, requests=st.requests + extra,
                                   free_kv_tokens=st.free_kv_tokens - sum(r.prompt_len + 1 for r in extra))

    def window_set(self, h: InstanceHandle, opening: bool, now: float) -> None:
        """The frontend opened or closed `h`'s window: count the opening, time the window when it closes."""
        if opening and not h.window_open:
            h.num_windows += 1
            h.window_opened_at = now
        elif not opening and h.window_open and h.window_opened_at is not None:
            h.window_lengths.observe(now - h.window_opened_at)
            h.window_opened_at = None
        h.window_open = opening

    def forget(self, request_id: str) -> None:
        self.routed_at.pop(request_id, None)
        self.first_token_at.pop(request_id, None)
