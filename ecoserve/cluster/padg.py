"""EcoServe (PaDG): temporal instances in macro instances, the overall scheduler and mitosis (paper A3-A7).

Every instance runs the `temporal` policy; each macro instance's router opens and closes their
windows (router.py). With mitosis, a periodic timer compares each macro instance's mean TTFT
(requests finished in the last `ttft_window` seconds, plus the age of those still waiting in its
router) and saved TPOT with the thresholds, and the topology changes are applied to the routers
here and announced to the driver as `Scale` actions; drained instances are released once empty.
"""
from __future__ import annotations

from collections import deque

from ecoserve.clock import Clock
from ecoserve.cluster.controller import ControllerBase, StatusBoard
from ecoserve.cluster.events import (Action, CloseWindow, Dispatch, InstanceSetup, RequestArrived, RequestFinished, Scale,
                                     SetTimer, TimerFired)
from ecoserve.cluster.mitosis import MitosisConfig, MitosisController, TopologyChange
from ecoserve.cluster.overall import OverallScheduler
from ecoserve.cluster.profile import PrefillProfile
from ecoserve.cluster.router import MacroInstance, RouterConfig


class PaDGController(ControllerBase):
    has_windows = True

    def __init__(self, clock: Clock, board: StatusBoard, profile: PrefillProfile, router: RouterConfig,
                 macro_sizes: list[int], total_instances: int | None = None, mitosis: MitosisConfig | None = None,
                 mitosis_period: float = 5.0, ttft_window: float = 30.0) -> None:
        total = total_instances or sum(macro_sizes)
        if sum(macro_sizes) > total:
            raise ValueError(f"macro instances of {macro_sizes} need {sum(macro_sizes)} instances, have {total}")
        super().__init__(clock, board, {i: InstanceSetup("both", "temporal", profile.budget) for i in range(total)})
        self.profile = profile
        self.router_config = router
        self.macros: dict[int, MacroInstance] = {}
        start = 0
        for m, n in enumerate(macro_sizes):
            self.macros[m] = MacroInstance(list(range(start, start + n)), profile, router, macro_id=m)
            start += n
        self.overall = OverallScheduler(self.macros)
        self.mitosis = None
        if mitosis is not None:
            self.mitosis = MitosisController(mitosis, {m: list(mac.instances) for m, mac in self.macros.items()},
                                             free=list(range(start, total)))
        self.mitosis_period = mitosis_period
        self.ttft_window = ttft_window
        self._recent: deque[tuple[float, int, float]] = deque()  # (time, macro, ttft)
        self._macro_of_request: dict[str, int] = {}
        self.timeline: list[dict] = []

    def macro_of(self, instance_id: int) -> MacroInstance | None:
        for mac in self.macros.values():
            if instance_id in mac.instances:
                return mac
        return None

    # ---- events ----------------------------------------------------------------------------
    def start(self) -> list[Action]:
        acts: list[Action] = [CloseWindow(i) for i in self.setups]  # instances start with an open window
        now = self.clock.now()
        if self.mitosis is not None:
            acts.append(SetTimer("mitosis", now + self.mitosis_period))
        if self.router_config.mode == "fixed_interval":
            acts.append(SetTimer("route", now + self.router_config.interval_frac * self.router_config.ttft_slo))
        return acts

    def on_arrival(self, req: RequestArrived) -> list[Action]:
        mac = self.overall.pick()
        return self._track(mac.submit(req.request_id, req.prompt_len, req.max_tokens, self.board, self.clock.now()))

    def _track(self, acts: list[Action]) -> list[Action]:
        if self.mitosis is not None:
            for a in acts:
                if isinstance(a, Dispatch):
                    mac = self.macro_of(a.instance_id)
                    self._macro_of_request[a.request_id] = mac.macro_id if mac is not None else 0
        return acts

    def retry_pending(self) -> list[Action]:
        acts: list[Action] = []
        now = self.clock.now()
        for mac in self.macros.values():
            if mac.pending:
                acts += mac.retry(self.board, now)
        return self._track(acts)

    def on_step(self, instance_id: int) -> list[Action]:
        acts = self.retry_pending()
        if self.mitosis is not None and instance_id in self.mitosis.draining \
                and self.board(instance_id).num_requests == 0:
            a = self.mitosis.release(instance_id)
            acts.append(Scale(a.kind, a.macro, a.instances, a.other))
        return acts

    def on_finished(self, e: RequestFinished) -> list[Action]:
        m = self._macro_of_request.pop(e.request_id, None)
        if self.mitosis is not None and e.ttft is not None:
            self._recent.append((self.clock.now(), m or 0, e.ttft))
        return []

    def on_timer(self, e: TimerFired) -> list[Action]:
        now = self.clock.now()
        if e.name == "route":
            acts: list[Action] = []
            for mac in self.macros.values():
                acts += mac.interval_tick(self.board, now)
            return self._track(acts) + [SetTimer("route", now + self.router_config.interval_frac
                                                 * self.router_config.ttft_slo)]
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
        if self.mitosis is not None:
            for members in self.mitosis.macros.values():
                if instance_id in members:
                    members.remove(instance_id)
            self.mitosis.draining.discard(instance_id)

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
            vals = [s for s in (mac.saved_tpot(self.board(i), now) for i in mac.instances) if s is not None]
            saved[m] = sum(vals) / len(vals) if vals else None
        changes = self.mitosis.step(now, mean_ttft, saved)
        changes += [self.mitosis.release(iid) for iid in list(self.mitosis.draining)
                    if self.board(iid).num_requests == 0]
        c = self.mitosis.count()
        self.timeline.append({"time": now, **c, "sizes": sorted(len(v) for v in self.mitosis.macros.values())})
        return self.apply_changes(changes)

    def apply_changes(self, changes: list[TopologyChange]) -> list[Action]:
        """Mirror mitosis steps (timed, or by hand) into the routers: the window and scale actions they
        cause, then the pending requests routed anew over the new topology."""
        acts: list[Action] = []
        for c in changes:
            acts += self._mirror(c)
            acts.append(Scale(c.kind, c.macro, c.instances, c.other))
        return acts + self.retry_pending()

    def _mirror(self, a: TopologyChange) -> list[Action]:
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
        return acts
