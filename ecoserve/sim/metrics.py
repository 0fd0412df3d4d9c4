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


def goodput(attain_at: Callable[[float], float], target: float | str = 0.9, lo: float = 0.1, hi: float = 8.0,
            rel_tol: float = 0.03, max_evals: int = 20, num_gpus: int | None = None) -> tuple[float, list[tuple[float, float]]]:
    """Highest rate whose attainment >= target: bracket by doubling, then bisect (curve assumed monotone-ish).

    Returns (rate, evaluated points); rate is per GPU when `num_gpus` is given. 0 if even `lo` fails.
    """
    t = TARGETS[target] if isinstance(target, str) else target
    seen: list[tuple[float, float]] = []

    def ok(rate: float) -> bool:
        a = attain_at(rate)
        seen.append((rate, a))
        return a >= t

    if not ok(lo):
        return 0.0, seen
    good = lo
    while ok(hi):
        good, hi = hi, hi * 2
        if len(seen) >= max_evals:
            break
    bad = hi
    while bad - good > rel_tol * good and len(seen) < max_evals:
        mid = (good + bad) / 2
        if ok(mid):
            good = mid
        else:
            bad = mid
    return (good / num_gpus if num_gpus else good), seen
