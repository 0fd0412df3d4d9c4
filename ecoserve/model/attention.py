"""The attention interface models call; backends own the KV cache layout.

A model layer computes q, k, v (rotary already applied) for the flattened tokens of a step and
calls `backend(layer_idx, q, k, v, scale)`. The paged backend the engine uses lives in
ecoserve.engine.attention.
"""
from __future__ import annotations

from typing import Protocol

import torch


class AttentionBackend(Protocol):
    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 scale: float) -> torch.Tensor:
        """q: [T, Hq, D]; k, v: [T, Hkv, D] -> [T, Hq, D]."""
        ...
