"""What a simulated instance would report as its start-up profile, so the router predicts as it does live.

A live instance times one prefill-only step at each of `PROFILE_TOKENS` and sends the rows to the
frontend, which reads them through `StepTimeTable`. The simulator "measures" its instances the same
way: the performance model's prefill-only step at those lengths, nothing else of the model, so
the router's predictions are off where a table of those rows is (between rows, and past the last).
"""
from __future__ import annotations

from typing import Iterable

from ecoserve.cluster.profile import PROFILE_TOKENS, StepTimeTable, profiling_lengths
from ecoserve.sim.perf import PerfModel


def measured_prefill_table(perf: PerfModel, max_num_batched_tokens: int, max_model_len: int | None = None,
                           token_counts: Iterable[int] = PROFILE_TOKENS) -> StepTimeTable:
    """The `tokens -> ms` rows a live instance with this performance would send at start-up."""
    return StepTimeTable([(n, perf.predicted_prefill_time(n) * 1e3)
                          for n in profiling_lengths(max_num_batched_tokens, max_model_len, token_counts)])
