"""Predicted prefill times from an instance's `tokens -> seconds` profile (paper A6: offline profiling).

`step_time(n)` is the duration of one prefill-only step of n prompt tokens: a measured table live,
the performance model in the simulator. A window's prompts run together (the `temporal` policy
packs them into steps of `max_num_batched_tokens`), so a window costs its batched prefill, not
the sum of single-prompt prefills.
"""
from __future__ import annotations

from typing import Callable

REFERENCE_ANCHORS = (16, 4096)  # the released router's profile lengths (tokens)


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

    def single(self, num_tokens: int) -> float:
        """One prompt alone, in one step."""
        return self._step(max(int(num_tokens), 1))

    def batched(self, total_tokens: int) -> float:
        """Prompts of `total_tokens` tokens together: full budget-sized steps, then the remainder."""
        if total_tokens <= 0:
            return 0.0
        full, rest = divmod(int(total_tokens), self.budget)
        return full * self._step(self.budget) + (self._step(rest) if rest else 0.0)

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
