"""Predicted step times: the one `tokens -> time` table, and prefill predictions over it (paper A6).

`StepTimeTable` reads a measured `tokens,ms` table of one forward step: the simulator's table
model, a mock instance and the live controller all read it, so they agree at every length.
`PrefillProfile.step_time(n)` is the duration of one prefill-only step of n prompt tokens: such
a table live, the performance model in the simulator. A window's prompts run together (the
`temporal` policy packs them into steps of `max_num_batched_tokens`), so a window costs its
batched prefill, not the sum of single-prompt prefills.
"""
from __future__ import annotations

import bisect
import csv
from pathlib import Path
from typing import Callable, Iterable

REFERENCE_ANCHORS = (16, 4096)  # the released router's profile lengths (tokens)
# Prompt lengths an instance times at start-up (`ecoserve instance --profile-tokens`), each capped at its
# token budget: up to a full step, so the router reads long prompts between rows, not past the last one.
PROFILE_TOKENS = (16, 64, 256, 1024, 4096)


def profiling_lengths(max_num_batched_tokens: int, max_model_len: int | None = None,
                      token_counts: Iterable[int] = PROFILE_TOKENS) -> list[int]:
    """The prompt lengths an instance times: each fits one step (the token budget) and the model's context."""
    counts = [int(n) for n in token_counts]
    if not counts or min(counts) < 1:
        raise ValueError(f"profile lengths must be positive token counts, got {counts}")
    cap = max_num_batched_tokens if max_model_len is None else min(max_num_batched_tokens, max_model_len - 1)
    return sorted({min(n, cap) for n in counts})


class StepTimeTable:
    """A measured `tokens -> ms` table of one forward step, read between and beyond its rows.

    Linear between rows; the first row's time at or below it; past the last row, linear along
    the upper half of the table (from the middle row to the last: over a long stretch the
    staircase of GEMM tiles averages out, where the last two rows alone may lie on one stair).
    The simulator's calibrated figures (docs/reproduction.md) were made with this rule, so it is
    the one everybody reads. A table of two rows extrapolates along both, one of a single row
    in proportion to it; a table whose upper half falls (noise in a short measured one) stays at
    its last row's time beyond it.
    """

    def __init__(self, rows: Iterable[tuple[float, float]]) -> None:
        pts = sorted((int(n), float(ms)) for n, ms in rows)
        if not pts:
            raise ValueError("a tokens -> time table needs at least one (tokens, ms) row")
        self.tokens = [n for n, _ in pts]
        self.times_ms = [ms for _, ms in pts]

    @classmethod
    def from_csv(cls, path: str | Path) -> "StepTimeTable":
        """A `tokens,ms` CSV; a header line and other non-numeric lines are skipped."""
        rows = []
        with open(path, newline="") as f:
            for row in csv.reader(f):
                try:
                    rows.append((int(float(row[0])), float(row[1])))
                except (ValueError, IndexError):
                    continue
        if not rows:
            raise ValueError(f"{path}: no 'tokens,ms' rows found")
        return cls(rows)

    @property
    def rows(self) -> list[tuple[int, float]]:
        return list(zip(self.tokens, self.times_ms))

    def ms(self, n: float) -> float:
        xs, ys = self.tokens, self.times_ms
        if n <= xs[0]:
            return ys[0]
        i = bisect.bisect_left(xs, n)
        if i >= len(xs):
            if len(xs) == 1:
                return ys[0] * n / max(xs[0], 1)
            j = min(len(xs) // 2, len(xs) - 2)
            slope = max((ys[-1] - ys[j]) / max(xs[-1] - xs[j], 1), 0.0)  # noisy rows: never faster past the end
            return ys[-1] + slope * (n - xs[-1])
        x0, x1 = xs[i - 1], xs[i]
        return ys[i - 1] + (ys[i] - ys[i - 1]) * (n - x0) / (x1 - x0)

    def seconds(self, n: float) -> float:
        return self.ms(n) * 1e-3


class PrefillProfile:
    def __init__(self, step_time: Callable[[int], float], max_num_batched_tokens: int) -> None:
        if max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {max_num_batched_tokens}")
        self.step_time = step_time
        self.budget = max_num_batched_tokens
        self._cache: dict[int, float] = {}
        self._ref_ms = {a: int(step_time(a) * 1000) for a in REFERENCE_ANCHORS}

    def _step(self, n: int) -> float:
        t = self._cache.get(n)
        if t is None:
            t = self._cache[n] = self.step_time(n)
        return t

    def batched(self, total_tokens: int) -> float:
        """Prompts of `total_tokens` tokens together: full budget-sized steps, then the remainder."""
        if total_tokens <= 0:
            return 0.0
        full, rest = divmod(int(total_tokens), self.budget)
        return full * self._step(self.budget) + (self._step(rest) if rest else 0.0)

    def alone(self, prompt_len: int) -> float:
        """One prompt prefilled on its own (Algorithm 1's per-request prediction): `step_time(prompt_len)`
        up to the token budget, budget-sized steps beyond it."""
        return self.batched(prompt_len)

    def reference_ms(self, num_tokens: int) -> int:
        """The released router's estimate: exact at an anchor, else scaled linearly from one, whole ms.

        Prompts up to 16 tokens scale from the 16-token anchor, longer ones from the 4096-token
        anchor (our reading of "scaled linearly from an anchor"; see docs/reproduction.md).
        """
        n = max(int(num_tokens), 1)
        if n in self._ref_ms:
            return self._ref_ms[n]
        anchor = REFERENCE_ANCHORS[0] if n <= REFERENCE_ANCHORS[0] else REFERENCE_ANCHORS[1]
        return int(self._ref_ms[anchor] * n / anchor)


def reference_blocks(prompt_len: int) -> int:
    """The released router's KV block count for a prompt (block size 16, one spare)."""
    return (prompt_len + 16) // 16
