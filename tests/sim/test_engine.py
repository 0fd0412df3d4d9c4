"""The event loop: M/D/1 against its closed form, event ordering, no lost requests."""
import numpy as np
import pytest

from ecoserve.sim.engine import EventLoop
from ecoserve.sim.events import Event


class Arrive(Event):
    priority = 30

    def handle(self, q):
        return q.arrive(self.time)


class Depart(Event):
    priority = 10

    def handle(self, q):
        return q.depart(self.time)


class MD1:
    def __init__(self, service):
        self.service, self.queue, self.busy, self.waits = service, [], False, []

    def arrive(self, t):
        self.queue.append(t)
        return self._start(t)

    def depart(self, t):
        self.busy = False
        return self._start(t)

    def _start(self, t):
        if self.busy or not self.queue:
            return []
        self.waits.append(t - self.queue.pop(0))
        self.busy = True
        return [Depart(t + self.service)]


def test_md1_mean_wait_matches_closed_form():
    lam, d, n = 0.7, 1.0, 60_000
    arrivals = np.cumsum(np.random.default_rng(7).exponential(1 / lam, n))
    loop, q = EventLoop(), MD1(d)
    loop.push(Arrive(float(t)) for t in arrivals)
    loop.run(q)
    rho = lam * d
    expected = rho * d / (2 * (1 - rho))  # Pollaczek-Khinchine for deterministic service
    assert len(q.waits) == n
    assert np.mean(q.waits) == pytest.approx(expected, rel=0.06)


class Log(Event):
    def __init__(self, time, tag, priority=50):
        super().__init__(time)
        self.tag, self.priority = tag, priority

    def handle(self, log):
        log.append((self.time, self.tag))
        return [Log(self.time, self.tag + "'", 99)] if self.tag == "spawn" else []


def test_events_run_by_time_then_priority_then_creation():
    loop, log = EventLoop(), []
    loop.push([Log(2.0, "late"), Log(1.0, "b", 50), Log(1.0, "a", 10), Log(1.0, "c", 50), Log(1.0, "spawn", 60)])
    loop.run(log)
    assert [t for _, t in log] == ["a", "b", "c", "spawn", "spawn'", "late"]
    assert loop.clock.now() == 2.0


def test_past_events_are_rejected_and_until_stops():
    loop, log = EventLoop(), []
    loop.push([Log(1.0, "x"), Log(5.0, "y")])
    loop.run(log, until=2.0)
    assert log == [(1.0, "x")] and loop.num_handled == 1
    with pytest.raises(ValueError, match="past"):
        loop.push(Log(0.5, "z"))
    loop.run(log)  # the event past `until` waited in the heap
    assert log == [(1.0, "x"), (5.0, "y")]
