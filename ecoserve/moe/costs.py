"""Cost tables for expert placement: one expert's compute time by tokens on each tier, and its transfer time.

A tier's compute curve is a callable `tokens -> seconds`: `RooflineCost` from the hardware's peak
numbers (what the simulator uses), `MeasuredCost` from timed points (what a GPU run measures).
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Callable, Sequence

ComputeCurve = Callable[[int], float]


@dataclass(frozen=True)
class RooflineCost:
    """One expert over n tokens: max(FLOPs / flops, weight bytes / bandwidth) + a fixed launch cost."""

    flops_per_token: float  # 2 x the expert's parameters
    weight_bytes: float
    flops: float  # achieved FLOP/s of the tier
    bandwidth: float  # achieved bytes/s from the memory that holds the weights
    launch_s: float = 0.0

    def __post_init__(self) -> None:
        if min(self.flops_per_token, self.weight_bytes, self.launch_s) < 0 or self.flops <= 0 or self.bandwidth <= 0:
            raise ValueError(f"roofline cost needs positive rates and non-negative sizes, got {self}")

    def __call__(self, tokens: int) -> float:
        if tokens <= 0:
            return 0.0
        return max(tokens * self.flops_per_token / self.flops, self.weight_bytes / self.bandwidth) + self.launch_s


@dataclass(frozen=True)
class MeasuredCost:
    """Timed points (tokens, seconds), linear between them, along the last segment past the end."""

    tokens: tuple[int, ...]
    seconds: tuple[float, ...]

    def __post_init__(self) -> None:
        if not self.tokens or len(self.tokens) != len(self.seconds):
            raise ValueError(f"measured cost needs matching, non-empty points, got {self.tokens} / {self.seconds}")
        if list(self.tokens) != sorted(set(self.tokens)) or self.tokens[0] < 1 or min(self.seconds) < 0:
            raise ValueError(f"measured cost points must have increasing token counts >= 1 and times >= 0, "
                             f"got {self.tokens} / {self.seconds}")

    @classmethod
    def of(cls, points: Sequence[tuple[int, float]]) -> "MeasuredCost":
        pts = sorted(points)
        return cls(tuple(int(n) for n, _ in pts), tuple(float(s) for _, s in pts))

    def __call__(self, tokens: int) -> float:
        if tokens <= 0:
            return 0.0
        xs, ys = self.tokens, self.seconds
        if tokens <= xs[0] or len(xs) == 1:
            return ys[0] if tokens <= xs[0] else ys[0] * tokens / xs[0]
        i = bisect.bisect_left(xs, tokens)
        if i == len(xs):
            i -= 1
        x0, x1 = xs[i - 1], xs[i]
        return max(ys[i - 1] + (ys[i] - ys[i - 1]) * (tokens - x0) / (x1 - x0), 0.0)


@dataclass(frozen=True)
class CostTable:
    """What the placement rule weighs: compute where the weights live (host) against moving them.

    `load_s` is one expert's transfer time host -> device; `base_load_s` what every layer moves
    before its experts (APTMoE's attention + gate; 0 when those stay resident, as in serving).
    """

    host_s: ComputeCurve
    device_s: ComputeCurve
    load_s: float
    base_load_s: float = 0.0

    def __post_init__(self) -> None:
        if self.load_s <= 0 or self.base_load_s < 0:
            raise ValueError(f"expert load time must be > 0 and base load >= 0, got {self.load_s}, {self.base_load_s}")

    @classmethod
    def from_link(cls, host_s: ComputeCurve, device_s: ComputeCurve, expert_bytes: float, link_bandwidth: float,
                  link_latency_s: float = 0.0, base_bytes: float = 0.0) -> "CostTable":
        """Transfer times from the bytes moved over a link (e.g. PCIe) of this achieved bandwidth."""
        if expert_bytes <= 0 or link_bandwidth <= 0:
            raise ValueError(f"need expert bytes and link bandwidth > 0, got {expert_bytes}, {link_bandwidth}")
        base = base_bytes / link_bandwidth + (link_latency_s if base_bytes else 0.0)
        return cls(host_s, device_s, expert_bytes / link_bandwidth + link_latency_s, base)
