"""Network model: collectives inside an instance and queued KV transfers between instances.

`LinkQueue` models one directional link (e.g. a node's NIC for FuDG KV migration) shared by
transfers: bandwidth is split equally among the transfers in flight (processor sharing), so a
burst of KV transfers queues behind each other the way it does on a saturated 10 GbE port.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ecoserve.sim.hardware import Link


def allreduce_time(nbytes: float, n: int, link: Link) -> float:
    """Ring all-reduce of `nbytes` over `n` ranks: 2(n-1)/n of the data over the link, 2(n-1) hops."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    bw = link.bandwidth * link.efficiency
    return 2 * (n - 1) / n * nbytes / bw + 2 * (n - 1) * link.latency


def send_time(nbytes: float, link: Link) -> float:
    return link.latency + nbytes / (link.bandwidth * link.efficiency)


@dataclass
class _Transfer:
    key: object
    remaining: float  # bytes


@dataclass
class LinkQueue:
    """Transfers sharing one link's bandwidth equally; advance with `advance_to(t)`."""

    link: Link
    time: float = 0.0
    active: list[_Transfer] = field(default_factory=list)
    pending: list[tuple[float, _Transfer]] = field(default_factory=list)  # (ready time, transfer): latency

    @property
    def rate(self) -> float:
        return self.link.bandwidth * self.link.efficiency

    def start(self, key: object, nbytes: float, now: float) -> None:
        self.advance_to(now)
        self.pending.append((now + self.link.latency, _Transfer(key, max(nbytes, 0.0))))

    def next_completion(self) -> float | None:
        """Virtual time at which the next transfer finishes if nothing else starts."""
        best = None
        t, active, pending = self.time, list(self.active), sorted(self.pending, key=lambda x: x[0])
        # Simulate forward without mutating: only the earliest completion is needed.
        while active or pending:
            n = len(active)
            t_done = t + min(x.remaining for x in active) * n / self.rate if n else float("inf")
            t_next = pending[0][0] if pending else float("inf")
            if t_done <= t_next:
                return t_done
            if n:
                drained = (t_next - t) * self.rate / n
                active = [_Transfer(x.key, x.remaining - drained) for x in active]
            t = t_next
            active.append(pending.pop(0)[1])
        return best

    def advance_to(self, now: float) -> list[object]:
        """Move time to `now`; return the keys of transfers finished by then, in finish order."""
        done: list[object] = []
        self.pending.sort(key=lambda x: x[0])
        while True:
            n = len(self.active)
            t_done = self.time + min(x.remaining for x in self.active) * n / self.rate if n else float("inf")
            t_next = self.pending[0][0] if self.pending else float("inf")
            t_evt = min(t_done, t_next)
            if t_evt > now + 1e-9:
                break
            if n:
                drained = (t_evt - self.time) * self.rate / n
                for x in self.active:
                    x.remaining -= drained
            self.time = t_evt
            if t_done <= t_next:
                # The transfer(s) with the least left finish now; compare against that, not zero,
                # so rounding can never leave a finished transfer spinning.
                least = min(x.remaining for x in self.active)
                finished = [x for x in self.active if x.remaining <= least + 1e-3]
                self.active = [x for x in self.active if x.remaining > least + 1e-3]
                done.extend(x.key for x in finished)
            else:
                self.active.append(self.pending.pop(0)[1])
        if self.active:
            drained = (now - self.time) * self.rate / len(self.active)
            for x in self.active:
                x.remaining -= drained
        self.time = max(self.time, now)
        return done

    @property
    def busy(self) -> bool:
        return bool(self.active or self.pending)
