"""EcoServe (PaDG): temporal instances in macro instances, the overall scheduler and mitosis (paper A3-A7).

Every instance runs the `temporal` policy; each macro instance's router opens and closes their
windows (router.py). With mitosis, a periodic timer compares each macro instance's mean TTFT
(the requests it routed that finished in the last `ttft_window` seconds, plus the age of those
still waiting in its router; none of either: no TTFT evidence, see mitosis.py) and saved TPOT with
the thresholds, and the topology changes are applied to the routers
here and announced to the driver as `Scale` actions; drained instances are released once empty.
The controller holds the one `MacroTopology` (the members of each macro instance, the free pool,
the draining instances): mitosis changes it, the routers follow, `topology()` reads it.
"""
from __future__ import annotations

from collections import deque
from typing import Any

from ecoserve.clock import Clock
from ecoserve.cluster.controller import NO_MITOSIS, ControllerBase
from ecoserve.cluster.events import (Action, CloseWindow, Dispatch, InstanceSetup, RequestArrived, RequestFinished,
                                     Scale, SetTimer, TimerFired)
from ecoserve.cluster.mitosis import MitosisConfig, MitosisController
from ecoserve.cluster.modes import ROUTER_MODES
from ecoserve.cluster.overall import OverallScheduler
from ecoserve.cluster.profile import PrefillProfile
from ecoserve.cluster.router import MacroInstance, RouterConfig
from ecoserve.cluster.status import StatusOf
from ecoserve.cluster.topology import MacroTopology, Topology


def padg_setups(num_instances: int, max_num_batched_tokens: int) -> dict[int, InstanceSetup]:
    """Every instance, the free pool's too, runs the temporal policy."""
    return {i: InstanceSetup("both", "temporal", max_num_batched_tokens) for i in range(num_instances)}


class PaDGController(ControllerBase):
    has_windows = True

    def __init__(self, clock: Clock, status_of: StatusOf, profile: PrefillProfile, router: RouterConfig,
                 macro_sizes: list[int], total_instances: int | None = None, mitosis: MitosisConfig | None = None,
                 mitosis_period: float = 5.0, ttft_window: float = 30.0) -> None:
        total = total_instances or sum(macro_sizes)
        if sum(macro_sizes) > total:
            raise ValueError(f"macro instances of {macro_sizes} need {sum(macro_sizes)} instances, have {total}")
        super().__init__(clock, status_of, padg_setups(total, profile.budget))
        self.profile = profile
        self.router_config = router
        self.route_period = ROUTER_MODES.get(router.mode).period(router)
        members, start = {}, 0
        for m, n in enumerate(macro_sizes):
            members[m] = list(range(start, start + n))
            start += n
        self.layout = MacroTopology(members, free=list(range(start, total)))
        self.macros: dict[int, MacroInstance] = {m: MacroInstance(list(v), profile, router, macro_id=m)
                                                 for m, v in members.items()}  # the routers, one per macro
        self.overall = OverallScheduler(self.macros, status_of)
        self.mitosis = MitosisController(mitosis, self.layout) if mitosis is not None else None
        self.mitosis_period = mitosis_period
        self.ttft_window = ttft_window
        self._recent: deque[tuple[float, int, float]] = deque()  # (time, macro, ttft)
        self._macro_of_request: dict[str, int] = {}
        self._homes: dict[int, int | None] = {}  # lost instance -> the macro it left (None: the free pool)
        self.timeline: list[dict] = []

    def macro_of(self, instance_id: int) -> MacroInstance | None:
        m = self.layout.macro_of(instance_id)
        return self.macros[m] if m is not None else None

    # ---- the driver surface ------------------------------------------------------------------
    def topology(self) -> Topology:
        return self.layout.freeze({i: s.role for i, s in self.setups.items()})

    def summary(self) -> dict[str, Any]:
        out = super().summary()
        if self.mitosis is not None:
            out["timeline"] = self.timeline
        return out

    def scale_by_hand(self, macro: int, delta: int) -> list[Action]:
        """+1: add a free instance to `macro` (split past N_u); -1: drain its newest instance."""
        if self.mitosis is None:
            raise ValueError(NO_MITOSIS)
        layout = self.layout
        if macro not in layout.macros:
            raise ValueError(f"no macro instance {macro}; there are {sorted(layout.macros)}")
        if delta == 1:
            if not layout.free:
                raise ValueError("no free instance left to add")
            changes = self.mitosis.expand(macro)
        elif delta == -1:
            if len(layout.macros[macro]) <= 1:
                raise ValueError(f"macro instance {macro} has one instance; it cannot shrink")
            changes = [self.mitosis.drain(macro)]
        else:
            raise ValueError(f"delta must be +1 or -1, got {delta!r}")
        return self._apply_changes(changes)

    # ---- events ----------------------------------------------------------------------------
    def start(self) -> list[Action]:
        acts: list[Action] = [CloseWindow(i) for i in self.setups]  # instances start with an open window
        now = self.clock.now()
        if self.mitosis is not None:
            acts.append(SetTimer("mitosis", now + self.mitosis_period))
        if self.route_period is not None:
            acts.append(SetTimer("route", now + self.route_period))
        return acts

    def on_arrival(self, req: RequestArrived) -> list[Action]:
        mac = self.overall.pick()
        return self._track(mac.submit(req.request_id, req.prompt_len, req.max_tokens, self.status_of,
                                      self.clock.now(), req.lora_name))

    def _track(self, acts: list[Action]) -> list[Action]:
        if self.mitosis is not None:
            for a in acts:
                if isinstance(a, Dispatch):
                    m = self.layout.macro_of(a.instance_id)
                    if m is not None:  # outside every macro instance (draining, free): not counted
                        self._macro_of_request[a.request_id] = m
        return acts

    def retry_pending(self) -> list[Action]:
        acts: list[Action] = []
        now = self.clock.now()
        for mac in self.macros.values():
            if mac.pending:
                acts += mac.retry(self.status_of, now)
        return self._track(acts)

    def on_step(self, instance_id: int) -> list[Action]:
        acts = self.retry_pending()
        if self.mitosis is not None and instance_id in self.layout.draining \
                and self.status_of(instance_id).num_requests == 0:
            acts.append(self.mitosis.release(instance_id))
        return acts

    def on_finished(self, e: RequestFinished) -> list[Action]:
        m = self._macro_of_request.pop(e.request_id, None)
        if m is not None and e.ttft is not None:
            self._recent.append((self.clock.now(), m, e.ttft))
        return []

    def on_timer(self, e: TimerFired) -> list[Action]:
        now = self.clock.now()
        if e.name == "route":
            acts: list[Action] = []
            for mac in self.macros.values():
                acts += mac.tick(self.status_of, now)
            return self._track(acts) + [SetTimer("route", now + self.route_period)]
        if e.name == "mitosis":
            return self._mitosis(now) + [SetTimer("mitosis", now + self.mitosis_period)]
        if e.name.startswith(("release/", "close/")):
            mac = self.macros.get(int(e.name.split("/")[1]))
            return mac.on_timer(e.name) if mac is not None else []
        raise ValueError(f"unknown timer {e.name!r}")

    def on_instance_lost(self, instance_id: int) -> None:
        mac = self.macro_of(instance_id)
        if mac is not None:
            mac.remove_instance(instance_id)
        self._homes[instance_id] = mac.macro_id if mac is not None else None
        self.layout.remove(instance_id)
        if instance_id in self.layout.free:
            self.layout.free.remove(instance_id)  # mitosis must not add a lost instance

    def on_instance_joined(self, instance_id: int) -> list[Action]:
        """A lost instance restarted in its slot goes back to its macro instance (or, if that is gone, to the
        free pool), with its window closed (instances start with one open)."""
        if instance_id not in self._homes:
            return []  # a first join: the start-up layout has it already
        home = self._homes.pop(instance_id)
        if home is not None and home in self.macros:
            self.layout.macros[home].append(instance_id)
            self.macros[home].add_instance(instance_id)
        else:  # it was free, or mitosis merged its macro instance away meanwhile
            self.layout.free.append(instance_id)
        return [CloseWindow(instance_id)] + self.retry_pending()

    # ---- mitosis ---------------------------------------------------------------------------
    def _mitosis(self, now: float) -> list[Action]:
        while self._recent and self._recent[0][0] < now - self.ttft_window:
            self._recent.popleft()
        ttft: dict[int, list[float]] = {m: [] for m in self.macros}
        for _, m, v in self._recent:
            ttft.setdefault(m, []).append(v)
        for m, mac in self.macros.items():  # requests stuck in the router count with their age
            ttft[m].extend(now - p.queued_time for p in mac.pending)
        mean_ttft = {m: sum(v) / len(v) for m, v in ttft.items() if v}
        saved = {}
        for m, mac in self.macros.items():
            vals = [s for s in (mac.saved_tpot(self.status_of(i), now) for i in mac.instances) if s is not None]
            saved[m] = sum(vals) / len(vals) if vals else None
        changes = self.mitosis.step(now, mean_ttft, saved)
        changes += [self.mitosis.release(iid) for iid in list(self.layout.draining)
                    if self.status_of(iid).num_requests == 0]
        c = self.mitosis.count()
        self.timeline.append({"time": now, **c, "sizes": sorted(len(v) for v in self.layout.macros.values())})
        return self._apply_changes(changes)

    def _apply_changes(self, changes: list[Scale]) -> list[Action]:
        """Mirror mitosis steps (timed, or by hand) into the routers: the window actions they cause and
        the steps themselves, then the pending requests routed anew over the new topology."""
        acts: list[Action] = []
        for c in changes:
            acts += self._mirror(c)
            acts.append(c)
        return acts + self.retry_pending()

    def _mirror(self, a: Scale) -> list[Action]:
        """Mirror one topology change into the routers; returns the window actions it causes."""
        acts: list[Action] = []
        if a.kind == "add":
            self.macros[a.macro].add_instance(a.instances[0])
        elif a.kind == "split":
            for iid in a.instances[1:]:
                acts += self.macros[a.macro].remove_instance(iid)
            self.macros[a.other] = MacroInstance(list(a.instances), self.profile, self.router_config, macro_id=a.other)
        elif a.kind == "drain":
            acts += self.macros[a.macro].remove_instance(a.instances[0])
        elif a.kind == "merge":
            gone = self.macros.pop(a.other)
            acts += gone.close()
            for iid in gone.instances:
                self.macros[a.macro].add_instance(iid)
            self.macros[a.macro].pending.extend(gone.pending)
            self._move_samples(a.other, a.macro)
        return acts

    def _move_samples(self, gone: int, keeper: int) -> None:
        """A merged-away macro instance's TTFT evidence, finished and in flight, now speaks for the keeper."""
        self._recent = deque((t, keeper if m == gone else m, v) for t, m, v in self._recent)
        for rid, m in self._macro_of_request.items():
            if m == gone:
                self._macro_of_request[rid] = keeper
