"""The attention interface models call; backends own the KV cache layout.

A model layer computes q, k, v (rotary already applied) for the flattened tokens of a step and
calls `backend(layer_idx, q, k, v, scale)`. The paged backend the engine uses lives in
ecoserve.engine.attention; `DenseCausalAttention` serves one sequence without a cache (tests).
"""
from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F


class AttentionBackend(Protocol):
    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 scale: float) -> torch.Tensor:
        """q: [T, Hq, D]; k, v: [T, Hkv, D] -> [T, Hq, D]."""
        ...


class DenseCausalAttention:
    """All tokens of the step are one sequence starting at position 0; no KV cache."""

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 scale: float) -> torch.Tensor:
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
            is_causal=True, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
        return out.transpose(0, 1)
