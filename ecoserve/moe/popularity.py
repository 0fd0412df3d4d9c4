"""Per-layer expert popularity: a running estimate of how many tokens the router sends to each expert."""
from __future__ import annotations

from typing import Sequence


class ExpertPopularity:
    """Exponential moving average of routed token counts, per layer and expert.

    `observe` takes the token counts of one step (the router's choices); `decay` is the weight the
    past keeps per step (0: only the last step counts). Ties in `ranked` go to the lower expert id,
    so decisions are deterministic.
    """

    def __init__(self, num_layers: int, num_experts: int, decay: float = 0.9) -> None:
        if num_layers < 1 or num_experts < 1:
            raise ValueError(f"need >= 1 layer and expert, got {num_layers} layers, {num_experts} experts")
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"popularity decay must be in [0, 1), got {decay}")
        self.num_layers, self.num_experts, self.decay = num_layers, num_experts, decay
        self._scores = [[0.0] * num_experts for _ in range(num_layers)]
        self.steps = [0] * num_layers

    def observe(self, layer: int, tokens_per_expert: Sequence[float]) -> None:
        if len(tokens_per_expert) != self.num_experts:
            raise ValueError(f"layer {layer}: {len(tokens_per_expert)} counts for {self.num_experts} experts")
        row, d = self._scores[layer], self.decay
        if self.steps[layer] == 0:  # the first step is the estimate, not a tenth of it
            row[:] = [float(n) for n in tokens_per_expert]
        else:
            for e, n in enumerate(tokens_per_expert):
                row[e] = d * row[e] + (1.0 - d) * n
        self.steps[layer] += 1

    def seed(self, layer: int, scores: Sequence[float]) -> None:
        """Start a layer from a known distribution (a trace, or the simulator's assumed skew)."""
        if len(scores) != self.num_experts:
            raise ValueError(f"layer {layer}: {len(scores)} scores for {self.num_experts} experts")
        self._scores[layer] = [float(s) for s in scores]
        self.steps[layer] = max(self.steps[layer], 1)

    def scores(self, layer: int) -> list[float]:
        return list(self._scores[layer])

    def ranked(self, layer: int) -> list[int]:
        """Expert ids of a layer, most popular first."""
        row = self._scores[layer]
        return sorted(range(self.num_experts), key=lambda e: (-row[e], e))
