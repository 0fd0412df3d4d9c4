"""Prompt-lookup proposals: the tokens that followed the latest earlier occurrence of the request's newest n-gram.

Deterministic (its q is one-hot) and free of any model: it pays off where the output repeats its context
(editing, summarising, code), and proposes nothing where no n-gram recurs.
"""
from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from ecoserve.request import Request


class NgramProposer:
    """Longest match first, from `prompt_lookup_max` down to `prompt_lookup_min` tokens."""

    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        self.min_n, self.max_n = prompt_lookup_min, prompt_lookup_max

    def propose(self, request: Request, k: int) -> list[int]:
        return lookup(request.all_token_ids, k, self.min_n, self.max_n)


def lookup(token_ids: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to `k` tokens that followed the latest earlier occurrence of the last n tokens (largest n that has one)."""
    total = len(token_ids)
    if k <= 0 or total < min_n + 1:
        return []
    tokens = np.asarray(token_ids, dtype=np.int64)
    last = tokens[-1]
    # occurrences of the newest token before its own position: every match of a longer n-gram ends at one of them
    ends = np.flatnonzero(tokens[:-1] == last)
    if ends.size == 0:
        return []
    for n in range(min(max_n, total - 1), min_n - 1, -1):
        cand = ends[ends >= n - 1]
        if cand.size == 0:
            continue
        if n > 1:
            pattern = tokens[total - n:total - 1]
            windows = sliding_window_view(tokens[:-1], n - 1)  # windows[s] = tokens[s:s + n - 1]
            ok = (windows[cand - (n - 1)] == pattern).all(axis=1)
            cand = cand[ok]
            if cand.size == 0:
                continue
        start = int(cand[-1]) + 1
        return token_ids[start:start + k]
    return []
