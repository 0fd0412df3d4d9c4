"""The discrete-event loop: a heap of events over a VirtualClock."""
from __future__ import annotations

import heapq
from typing import Iterable

from ecoserve.clock import VirtualClock
from ecoserve.sim.events import Event


class EventLoop:
    def __init__(self, clock: VirtualClock | None = None) -> None:
        self.clock = clock or VirtualClock()
        self._heap: list[tuple[tuple[float, int, int], Event]] = []
        self.num_handled = 0

    def push(self, events: Iterable[Event] | Event | None) -> None:
        if events is None:
            return
        if isinstance(events, Event):
            events = (events,)
        now = self.clock.now()
        for e in events:
            if e.time < now - 1e-12:
                raise ValueError(f"{e!r} is scheduled in the past (now={now:.6f})")
            heapq.heappush(self._heap, (e.key(), e))

    def run(self, sim, until: float | None = None, progress=None) -> None:
        """Pop events in (time, priority, seq) order and let each handle itself."""
        heap, clock = self._heap, self.clock
        while heap:
            if until is not None and heap[0][0][0] > until:
                break
            _, event = heapq.heappop(heap)
            if event.time > clock.now():
                clock.advance_to(event.time)
            follow = event.handle(sim)
            if follow:
                self.push(follow)
            self.num_handled += 1
            if progress is not None:
                progress(event)
