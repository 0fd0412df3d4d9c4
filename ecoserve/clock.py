"""Time as the schedulers see it: wall time in the live engine, virtual time in the simulator."""
from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    def now(self) -> float: ...


class WallClock:
    """Seconds from time.monotonic(); the live engine's clock."""

    def now(self) -> float:
        return time.monotonic()


class VirtualClock:
    """A clock the simulator advances explicitly."""

    def __init__(self, start: float = 0.0) -> None:
        self._now = start

    def now(self) -> float:
        return self._now

    def advance_to(self, t: float) -> None:
        if t < self._now:
            raise ValueError(f"virtual time cannot go backwards ({t} < {self._now})")
        self._now = t
