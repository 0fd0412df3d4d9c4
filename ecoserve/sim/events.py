"""Simulator events: one small class per kind; each handles itself and returns what follows.

`handle(sim)` runs at the event's time (the engine has already advanced the clock) and returns
the events it causes. Ties at the same time run in `priority` order, then in creation order.
"""
from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Iterable

if TYPE_CHECKING:
    from ecoserve.sim.workload import SimRequest

_seq = itertools.count()


class Event:
    priority = 50  # lower runs first among events at the same time

    def __init__(self, time: float) -> None:
        self.time = time
        self.seq = next(_seq)

    def key(self) -> tuple[float, int, int]:
        return (self.time, self.priority, self.seq)

    def handle(self, sim) -> Iterable["Event"]:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}(t={self.time:.6f})"


class StepEnd(Event):
    """An instance's forward step finished: account it, then let the instance and cluster react."""

    priority = 10

    def __init__(self, time: float, instance) -> None:
        super().__init__(time)
        self.instance = instance

    def handle(self, sim) -> Iterable[Event]:
        return sim.on_step_end(self.instance)


class LinkCompletion(Event):
    """A KV transfer (FuDG) may have finished on a link."""

    priority = 20

    def __init__(self, time: float, link_id) -> None:
        super().__init__(time)
        self.link_id = link_id

    def handle(self, sim) -> Iterable[Event]:
        return sim.on_link(self.link_id)


class RequestArrival(Event):
    priority = 30

    def __init__(self, time: float, request: "SimRequest") -> None:
        super().__init__(time)
        self.request = request

    def handle(self, sim) -> Iterable[Event]:
        return sim.on_arrival(self.request)


class Timer(Event):
    """A timer a controller set (`SetTimer`): mitosis checks, fixed-interval routing, output-hold release."""

    priority = 40

    def __init__(self, time: float, name: str) -> None:
        super().__init__(time)
        self.name = name

    def handle(self, sim) -> Iterable[Event]:
        return sim.on_timer(self.name)
