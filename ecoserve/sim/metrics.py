"""Request metrics with EcoServe's definitions, SLO attainment and goodput search.

TTFT (EcoServe, paper A5) runs from arrival until the request's *decode phase begins*: its first
token exists *and* the instance has switched to decoding it (other requests' prefills or a FuDG
KV transfer delay that). TPOT is measured after that switch: (finish - decode start) / (out - 1).

The output hold (reference mode: a prefill instance's tokens are kept from clients until the
switch away from it or S_TTFT) changes when tokens *reach the client*, so both drivers record that
too: `first_delivery` and `last_delivery`. A held request's tokens reach the client at the
release, or at once when it finishes while held (the frontend flushes a finished request). A hold
is charged to TTFT, never credited to TPOT:

- TTFT = max(decode start, first delivery) - arrival. Without a hold the first delivery is the
  first token (<= decode start), so this is the plain EcoServe TTFT.
- TPOT = (finish - decode start) / (out - 1) with the instance's decode start, never moved by a
  hold: a burst delivered at a release does not make decoding faster (the client renders it at
  its own pace), so no request gets TPOT 0 from a hold.

The client's view as the common benchmarks (vLLM's) measure it is kept as extra fields:
`ttft_first_token` = first delivery - arrival and `tpot_delivered` = (last delivery - first
delivery) / (out - 1). SLO attainment uses `ttft` and `tpot`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

import numpy as np


@dataclass(frozen=True)
class RequestRecord:
    request_id: str
    arrival: float
    first_token: float  # end of the step that sampled its first token
    decode_start: float  # start of its first decode step (or first_token if it has one output token)
    finish: float
    input_len: int
    output_len: int
    first_delivery: float | None = None  # its first token reached the client (None: at first_token)
    last_delivery: float | None = None  # its last token reached the client (None: at finish)

    def __post_init__(self) -> None:
        if self.first_delivery is None:
            object.__setattr__(self, "first_delivery", self.first_token)
        if self.last_delivery is None:
            object.__setattr__(self, "last_delivery", self.finish)

    @property
    def ttft(self) -> float:
        return max(self.decode_start, self.first_delivery) - self.arrival

    @property
    def ttft_first_token(self) -> float:
        """The first token as the client receives it (vLLM's benchmark TTFT)."""
        return self.first_delivery - self.arrival

    @property
    def tpot(self) -> float:
        return (self.finish - self.decode_start) / (self.output_len - 1) if self.output_len > 1 else 0.0

    @property
    def tpot_delivered(self) -> float:
        """The pace the client received tokens at after the first (vLLM's benchmark TPOT)."""
        return (self.last_delivery - self.first_delivery) / (self.output_len - 1) if self.output_len > 1 else 0.0

    @property
    def e2e(self) -> float:
        return self.finish - self.arrival

    def meets(self, ttft_slo: float, tpot_slo: float) -> bool:
        return self.ttft <= ttft_slo and self.tpot <= tpot_slo


def attainment(records: Iterable[RequestRecord], ttft_slo: float, tpot_slo: float, num_submitted: int | None = None) -> float:
    """Fraction of requests meeting both SLOs; unfinished requests (num_submitted) count as misses."""
    recs = list(records)
    total = num_submitted if num_submitted is not None else len(recs)
    if total == 0:
        return 1.0
    return sum(r.meets(ttft_slo, tpot_slo) for r in recs) / total


def summarize(records: Iterable[RequestRecord], ttft_slo: float | None = None, tpot_slo: float | None = None,
              num_submitted: int | None = None) -> dict:
    recs = list(records)
    out: dict = {"num_finished": len(recs)}
    if not recs:
        return out
    for name in ("ttft", "ttft_first_token", "tpot", "tpot_delivered", "e2e"):
        v = np.array([getattr(r, name) for r in recs])
        out[name] = {"mean": float(v.mean()), "p50": float(np.percentile(v, 50)),
                     "p90": float(np.percentile(v, 90)), "p99": float(np.percentile(v, 99))}
    span = max(r.finish for r in recs) - min(r.arrival for r in recs)
    out["throughput_req_s"] = len(recs) / span if span > 0 else float("inf")
    out["output_tok_s"] = sum(r.output_len for r in recs) / span if span > 0 else float("inf")
    if ttft_slo is not None and tpot_slo is not None:
        out["attainment"] = attainment(recs, ttft_slo, tpot_slo, num_submitted)
    return out


TARGETS = {"p50": 0.5, "p90": 0.9, "p99": 0.99}
GOODPUT_TARGETS = ("p90", "p99")
GOODPUT_DEFINITIONS = ("monotone", "max")


@dataclass(frozen=True)
class CurvePoint:
    """One rate of an attainment curve: both SLOs met over all submitted requests, and the p90 latencies."""
    rate: float
    attainment: float
    ttft_p90: float | None = None
    tpot_p90: float | None = None


@dataclass(frozen=True)
class CurveConfig:
    """How a curve walks its geometric grid (rates start * ratio**k).

    It climbs until attainment is below `stop_below` at `stop_after` consecutive rates: past that point
    neither goodput definition can move for any target >= stop_below. When the start rate itself misses
    the highest target it first steps down (at most `max_below` rates) until one meets it, so that the
    monotone goodput has a passing rate under it; `max_points` bounds the climb.
    """
    ratio: float = 1.2
    stop_below: float = 0.5
    stop_after: int = 2
    max_points: int = 30
    max_below: int = 8

    def __post_init__(self) -> None:
        if not self.ratio > 1:
            raise ValueError(f"a curve's grid ratio must be > 1 (rates start * ratio**k), got {self.ratio}")
        if not 0 < self.stop_below <= 1:
            raise ValueError(f"stop_below is an attainment in (0, 1], got {self.stop_below}")
        if self.stop_after < 1 or self.max_points < 1 or self.max_below < 0:
            raise ValueError(f"need stop_after >= 1, max_points >= 1, max_below >= 0, got {self.stop_after}, "
                             f"{self.max_points}, {self.max_below}")


def attainment_curve(attain_at: Callable[[float], CurvePoint | float], start: float,
                     config: CurveConfig = CurveConfig(), targets=GOODPUT_TARGETS) -> list[CurvePoint]:
    """Evaluate `attain_at` on the grid of `config` from `start`; the points come back sorted by rate."""
    top = max(TARGETS[t] if isinstance(t, str) else t for t in targets)

    def at(rate: float) -> CurvePoint:
        v = attain_at(rate)
        return v if isinstance(v, CurvePoint) else CurvePoint(rate, float(v))

    grid = lambda k: round(start * config.ratio ** k, 6)
    points = [at(start)]
    for k in range(1, config.max_below + 1):
        if points[0].attainment >= top:
            break
        points.insert(0, at(grid(-k)))
    k, misses = 0, int(points[-1].attainment < config.stop_below)
    while misses < config.stop_after and len(points) < config.max_points:
        k += 1
        points.append(at(grid(k)))
        misses = misses + 1 if points[-1].attainment < config.stop_below else 0
    return points


def goodput_from_curve(points: Iterable[CurvePoint], target: float | str = 0.9) -> dict[str, float]:
    """Both goodput definitions from one curve (0.0 where no rate qualifies).

    `monotone`: the highest rate meeting the target with every lower rate of the curve meeting it too;
    `max`: the highest rate meeting it at all (the two differ where attainment dips and recovers).
    """
    t = TARGETS[target] if isinstance(target, str) else target
    pts = sorted(points, key=lambda p: p.rate)
    monotone = 0.0
    for p in pts:
        if p.attainment < t:
            break
        monotone = p.rate
    return {"monotone": monotone, "max": max((p.rate for p in pts if p.attainment >= t), default=0.0)}


def goodputs(points: Iterable[CurvePoint], targets=GOODPUT_TARGETS) -> dict[str, dict[str, float]]:
    """{target: {definition: rate}} for each target, all from the same curve."""
    pts = list(points)
    return {t: goodput_from_curve(pts, t) for t in targets}
