"""Output-length predictors: how many tokens a request will generate, guessed at admission.

TD-Pipe's greedy prefill simulates KV usage over *predicted* output lengths. The authors use a
BERT regressor that returns the mean of a length bucket; here are the stand-ins a reproduction
needs: the oracle (the request's own max_tokens, as in offline benchmarks with ignore_eos) with
optional multiplicative noise, bucket means from a length histogram, and a fixed constant.
"""
from __future__ import annotations

import bisect
import random
from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence

from ecoserve.request import Request


class OutputLengthPredictor(Protocol):
    def predict(self, request: Request) -> int: ...


def _true_length(request: Request) -> int:
    return max(request.max_output_tokens, 1) if request.sampling_params.max_tokens is not None else 1 << 16


@dataclass
class OracleWithNoise:
    """The true length (max_tokens) times (1 + N(0, noise)), at least 1; noise 0 is the exact oracle."""

    noise: float = 0.0
    seed: int = 0
    _rng: random.Random = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.noise < 0:
            raise ValueError(f"predictor noise must be >= 0, got {self.noise}")
        self._rng = random.Random(self.seed)

    def predict(self, request: Request) -> int:
        true = _true_length(request)
        if not self.noise:
            return true
        return max(1, round(true * (1.0 + self._rng.gauss(0.0, self.noise))))


@dataclass(frozen=True)
class BucketMeans:
    """The mean length of the bucket the true length falls in (the authors' predictor, with a perfect classifier).

    `boundaries` split lengths into buckets [0, b0), [b0, b1), ..., [b_last, inf); the means come
    from a histogram of observed output lengths (e.g. the dataset's).
    """

    boundaries: tuple[int, ...]
    means: tuple[float, ...]

    @classmethod
    def from_lengths(cls, lengths: Sequence[int], boundaries: Sequence[int] = (42, 141, 294, 503)) -> "BucketMeans":
        bounds = tuple(sorted(boundaries))
        groups: list[list[int]] = [[] for _ in range(len(bounds) + 1)]
        for n in lengths:
            groups[bisect.bisect_right(bounds, n)].append(n)
        edges = (0,) + bounds
        means = tuple(sum(g) / len(g) if g else float(edges[i]) for i, g in enumerate(groups))
        return cls(bounds, means)

    def predict(self, request: Request) -> int:
        return max(1, round(self.means[bisect.bisect_right(self.boundaries, _true_length(request))]))


@dataclass(frozen=True)
class FixedLength:
    length: int = 256

    def predict(self, request: Request) -> int:
        return self.length


PREDICTORS: dict[str, Callable[..., OutputLengthPredictor]] = {
    "oracle": OracleWithNoise, "constant": FixedLength,
}


def make_predictor(name: str, **kwargs) -> OutputLengthPredictor:
    if name not in PREDICTORS:
        raise ValueError(f"unknown output-length predictor {name!r}; choose one of {sorted(PREDICTORS)} "
                         f"(or pass a BucketMeans built from a length histogram)")
    return PREDICTORS[name](**kwargs)
