"""The cluster timeline: each instance's phase over time, its prefill windows, and where requests went.

Pure data, so the simulator and the live frontend record the same thing and one plot draws both.
`TimelineRecorder` takes events as they happen (bounded: a live frontend runs for days) and
`snapshot(now)` closes what is still open into a `ClusterTimeline`.
"""
from __future__ import annotations

import json
from collections import deque
from dataclasses import asdict, dataclass, field

from ecoserve.states import Phase

DEFAULT_MAX_EVENTS = 20_000  # per kind: phase segments, windows, routed points


@dataclass(frozen=True)
class PhaseSegment:
    instance_id: int
    start: float
    end: float
    phase: Phase


@dataclass(frozen=True)
class WindowInterval:
    """An instance held the prefill window (the router sent it new prompts) from `start` to `end`."""

    instance_id: int
    start: float
    end: float


@dataclass(frozen=True)
class RoutedPoint:
    time: float
    instance_id: int


@dataclass
class ClusterTimeline:
    """Times are seconds on one clock (virtual in the simulator, since the frontend started live)."""

    instances: list[int] = field(default_factory=list)
    phases: list[PhaseSegment] = field(default_factory=list)
    windows: list[WindowInterval] = field(default_factory=list)
    routed: list[RoutedPoint] = field(default_factory=list)

    def to_json(self) -> dict:
        return {"instances": list(self.instances), "phases": [asdict(s) for s in self.phases],
                "windows": [asdict(w) for w in self.windows], "routed": [asdict(r) for r in self.routed]}

    @classmethod
    def from_json(cls, data: dict | str) -> "ClusterTimeline":
        if isinstance(data, str):
            data = json.loads(data)
        return cls([int(i) for i in data.get("instances", [])],
                   [PhaseSegment(**s) for s in data.get("phases", [])],
                   [WindowInterval(**w) for w in data.get("windows", [])],
                   [RoutedPoint(**r) for r in data.get("routed", [])])


class TimelineRecorder:
    """Collects phase changes, window opens/closes and dispatches; keeps the last `max_events` of each."""

    def __init__(self, instances: list[int] = (), max_events: int = DEFAULT_MAX_EVENTS) -> None:
        self.instances: set[int] = set(instances)
        self._phases: deque[PhaseSegment] = deque(maxlen=max_events)
        self._windows: deque[WindowInterval] = deque(maxlen=max_events)
        self._routed: deque[RoutedPoint] = deque(maxlen=max_events)
        self._phase_now: dict[int, tuple[Phase, float]] = {}  # instance -> (current phase, since)
        self._open: dict[int, float] = {}  # instance -> when its window opened

    def phase(self, time: float, instance_id: int, phase: Phase) -> None:
        """The instance is in `phase` from `time` on (a repeat of the current phase changes nothing)."""
        self.instances.add(instance_id)
        cur = self._phase_now.get(instance_id)
        if cur is not None:
            if cur[0] == phase:
                return
            if time > cur[1]:
                self._phases.append(PhaseSegment(instance_id, cur[1], time, cur[0]))
        self._phase_now[instance_id] = (phase, time)

    def window_opened(self, time: float, instance_id: int) -> None:
        self.instances.add(instance_id)
        self._open.setdefault(instance_id, time)

    def window_closed(self, time: float, instance_id: int) -> None:
        start = self._open.pop(instance_id, None)
        if start is not None:
            self._windows.append(WindowInterval(instance_id, start, time))

    def routed(self, time: float, instance_id: int) -> None:
        self.instances.add(instance_id)
        self._routed.append(RoutedPoint(time, instance_id))

    def snapshot(self, now: float) -> ClusterTimeline:
        """Everything recorded, with the current phases and open windows cut at `now`."""
        phases = list(self._phases) + [PhaseSegment(i, t, now, p) for i, (p, t) in self._phase_now.items() if now > t]
        windows = list(self._windows) + [WindowInterval(i, t, now) for i, t in self._open.items()]
        return ClusterTimeline(sorted(self.instances), phases, windows, list(self._routed))
