"""Baseline routers: NoDG (replicas behind a load balancer) and FuDG (prefill -> KV -> decode)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from ecoserve.cluster.status import InstanceStatus

StatusOf = Callable[[int], InstanceStatus]


def _load(st: InstanceStatus) -> tuple[int, int]:
    return (st.num_requests, -st.free_kv_tokens)


@dataclass
class NoDGRouter:
    """Each request goes to one replica that prefills and decodes it (vLLM, Sarathi)."""

    instances: list[int]
    policy: str = "round_robin"  # | "least_loaded" (fewest requests, then most free KV)
    _next: int = 0

    def __post_init__(self) -> None:
        if self.policy not in ("round_robin", "least_loaded"):
            raise ValueError(f"policy must be 'round_robin' or 'least_loaded', got {self.policy!r}")

    def route(self, status_of: StatusOf) -> int:
        if self.policy == "round_robin":
            iid = self.instances[self._next % len(self.instances)]
            self._next += 1
            return iid
        return min(self.instances, key=lambda i: _load(status_of(i)))


@dataclass
class FuDGRouter:
    """Prefill on a prefill instance, ship the KV, decode on a decode instance (DistServe, MoonCake).

    Prefill instances are picked least-loaded (queued prompt tokens are what delay TTFT); decode
    instances by most free KV, since they hold nearly all of it (the paper's memory imbalance).
    """

    prefill: list[int]
    decode: list[int]
    _rr: dict[str, int] = field(default_factory=lambda: {"p": 0, "d": 0})

    def __post_init__(self) -> None:
        if not self.prefill or not self.decode:
            raise ValueError(f"FuDG needs at least one prefill and one decode instance, got "
                             f"{len(self.prefill)}P:{len(self.decode)}D")

    def route_prefill(self, status_of: StatusOf) -> int:
        return min(self.prefill, key=lambda i: (sum(q.prompt_len for q in status_of(i).requests), i))

    def route_decode(self, status_of: StatusOf, kv_tokens: int) -> int | None:
        """The decode instance with most free KV, or None if none has room for `kv_tokens`."""
        best = max(self.decode, key=lambda i: (status_of(i).free_kv_tokens, -i))
        return best if status_of(best).free_kv_tokens >= kv_tokens else None
