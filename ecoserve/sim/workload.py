"""Workloads: arrival processes, dataset-shaped length distributions and trace replay.

Length distributions are synthetic stand-ins for the datasets (we do not ship the data): each
input / output length is a log-normal clipped to a range, with the log-mean solved so that the
*clipped* mean equals the published mean (EcoServe Table 4). The spreads (sigma) and ranges are
our choice, picked to resemble the datasets' shapes:

| dataset   | input mean, sigma, range      | output mean, sigma, range |
|-----------|-------------------------------|---------------------------|
| alpaca    | 20.63, 0.6, [2, 512]          | 163.80, 0.7, [2, 1024]    |
| sharegpt  | 343.76, 1.2, [4, 4096]        | 237.20, 1.0, [4, 2048]    |
| longbench | 2686.89, 0.5, [256, 16384]    | 101.78, 0.6, [8, 512]     |

Traces replay from CSV (columns arrival_time,input_len,output_len; a header is optional) or
JSONL (keys arrival_time / input_len / output_len, or timestamp / prompt_len / output_len).
"""
from __future__ import annotations

import csv
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ecoserve.registry import Registry


@dataclass(frozen=True)
class SimRequest:
    request_id: str
    arrival_time: float
    input_len: int
    output_len: int
    lora_name: str | None = None  # the LoRA adapter it runs with (sim/lora.py); None: the base model


@dataclass(frozen=True)
class LengthDist:
    """Clipped log-normal whose clipped mean is `mean`."""

    mean: float
    sigma: float
    low: int
    high: int

    def _mu(self) -> float:
        z = np.random.default_rng(12345).standard_normal(200_000)
        lo, hi = math.log(self.low) - 5, math.log(self.high) + 5
        for _ in range(80):
            mid = (lo + hi) / 2
            m = np.clip(np.exp(mid + self.sigma * z), self.low, self.high).mean()
            lo, hi = (mid, hi) if m < self.mean else (lo, mid)
        return (lo + hi) / 2

    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray:
        mu = _MU_CACHE.get(self) or _MU_CACHE.setdefault(self, self._mu())
        x = np.exp(mu + self.sigma * rng.standard_normal(n))
        return np.clip(np.rint(x), self.low, self.high).astype(np.int64)


_MU_CACHE: dict[LengthDist, float] = {}


@dataclass(frozen=True)
class Dataset:
    name: str
    input: LengthDist
    output: LengthDist
    ttft_slo: float  # EcoServe Table 4, seconds
    tpot_slo: float


DATASETS: Registry[Dataset] = Registry("dataset")
DATASETS.add("alpaca", Dataset("alpaca", LengthDist(20.63, 0.6, 2, 512), LengthDist(163.80, 0.7, 2, 1024), 1.0, 0.1))
DATASETS.add("sharegpt", Dataset("sharegpt", LengthDist(343.76, 1.2, 4, 4096), LengthDist(237.20, 1.0, 4, 2048), 5.0, 0.1))
DATASETS.add("longbench", Dataset("longbench", LengthDist(2686.89, 0.5, 256, 16384), LengthDist(101.78, 0.6, 8, 512),
                                   15.0, 0.1))


# ---- arrival processes: rate (req/s), n, rng -> arrival times ------------------------------
ARRIVALS: Registry = Registry("arrival process")


@ARRIVALS.register("poisson")
def poisson_arrivals(rate: float, n: int, rng: np.random.Generator, cv: float = 1.0) -> np.ndarray:
    return np.cumsum(rng.exponential(1.0 / rate, n))


@ARRIVALS.register("gamma")
def gamma_arrivals(rate: float, n: int, rng: np.random.Generator, cv: float = 1.0) -> np.ndarray:
    """Gamma inter-arrival gaps with mean 1/rate and coefficient of variation `cv` (burstiness)."""
    if cv <= 0:
        raise ValueError(f"cv must be > 0, got {cv}")
    shape = 1.0 / cv ** 2
    return np.cumsum(rng.gamma(shape, 1.0 / (rate * shape), n))


@ARRIVALS.register("uniform")
def uniform_arrivals(rate: float, n: int, rng: np.random.Generator, cv: float = 1.0) -> np.ndarray:
    return np.arange(1, n + 1) / rate


def synthetic(dataset: str | Dataset, rate: float, num_requests: int, seed: int = 0, arrival: str = "poisson",
              cv: float = 1.0, max_model_len: int | None = None, start: float = 0.0) -> list[SimRequest]:
    """`num_requests` requests of a dataset's shape arriving at `rate` req/s."""
    ds = DATASETS.get(dataset) if isinstance(dataset, str) else dataset
    rng = np.random.default_rng(seed)
    times = start + ARRIVALS.get(arrival)(rate, num_requests, rng, cv=cv)
    ins = ds.input.sample(num_requests, rng)
    outs = ds.output.sample(num_requests, rng)
    if max_model_len is not None:  # truncate prompts the way the paper does for Llama-30B (2048)
        outs = np.minimum(outs, max_model_len // 2)
        ins = np.minimum(ins, max_model_len - outs)
    return [SimRequest(f"r{i}", float(t), int(a), int(b)) for i, (t, a, b) in enumerate(zip(times, ins, outs))]


def rate_schedule(dataset: str | Dataset, steps: list[tuple[float, float]], seed: int = 0) -> list[SimRequest]:
    """Piecewise-constant Poisson rates: [(rate, duration_s), ...] back to back."""
    out: list[SimRequest] = []
    t0 = 0.0
    for k, (rate, dur) in enumerate(steps):
        n = max(int(rate * dur * 1.5) + 10, 1)
        part = [r for r in synthetic(dataset, rate, n, seed=seed + k, start=t0) if r.arrival_time < t0 + dur]
        base = len(out)
        out.extend([SimRequest(f"r{base + i}", r.arrival_time, r.input_len, r.output_len) for i, r in enumerate(part)])
        t0 += dur
    return out


_KEYS = {"arrival_time": ("arrival_time", "timestamp", "arrival", "time"),
         "input_len": ("input_len", "prompt_len", "input_length", "prompt_tokens", "num_prompt_tokens"),
         "output_len": ("output_len", "output_length", "completion_tokens", "num_output_tokens")}


def _pick(row: dict, field: str):
    for k in _KEYS[field]:
        if k in row and row[k] not in ("", None):
            return row[k]
    raise ValueError(f"trace row {row} has no {field} (accepted names: {', '.join(_KEYS[field])})")


def load_trace(path: str | Path, time_scale: float = 1.0) -> list[SimRequest]:
    """Replay a CSV or JSONL trace; arrival times are shifted to start at 0 and scaled."""
    p = Path(path)
    rows: list[dict] = []
    if p.suffix in (".jsonl", ".json"):
        rows = [json.loads(line) for line in p.read_text().splitlines() if line.strip()]
    else:
        with open(p, newline="") as f:
            first = f.readline()
            f.seek(0)
            if any(c.isalpha() for c in first):
                rows = list(csv.DictReader(f))
            else:
                rows = [dict(zip(("arrival_time", "input_len", "output_len"), r)) for r in csv.reader(f) if r]
    reqs = [(float(_pick(r, "arrival_time")), int(float(_pick(r, "input_len"))), int(float(_pick(r, "output_len"))))
            for r in rows]
    if not reqs:
        raise ValueError(f"{path}: the trace is empty")
    reqs.sort()
    t0 = reqs[0][0]
    return [SimRequest(f"r{i}", (t - t0) * time_scale, max(a, 1), max(b, 1)) for i, (t, a, b) in enumerate(reqs)]
