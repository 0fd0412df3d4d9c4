"""Rotary position embedding: a cos/sin table per position, indexed by each token's position.

Frequencies follow transformers' formulas so the numerics match HF exactly: float32 angles
`position * inv_freq`, cos/sin cast to the model dtype.

Dynamic NTK: for positions below `max_position_embeddings` HF uses the unscaled frequencies,
and so do we (exact match). Beyond it HF rescales the base from the longest position of the
*current forward call*, which a paged KV cache cannot reproduce (cached keys keep the rotation
they were written with). We give position p the base HF uses when p is the newest token
(seq_len = p + 1): that equals HF's token-by-token decoding, and differs from HF only for
prompts that are prefilled past the limit in one call.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from ecoserve.model.spec import RopeSpec


def inv_frequencies(rope: RopeSpec, dim: int, max_positions: int) -> torch.Tensor:
    """float32 [dim // 2] inverse frequencies of the (position-independent) rope variants."""
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    inv_freq = 1.0 / (rope.theta ** exponents)
    if rope.rope_type == "linear":
        inv_freq = inv_freq / rope.factor
    elif rope.rope_type == "llama3":
        inv_freq = _llama3(inv_freq, rope, max_positions)
    return inv_freq


def _llama3(inv_freq: torch.Tensor, rope: RopeSpec, max_positions: int) -> torch.Tensor:
    # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, the band between blended
    old_len = rope.original_max_position_embeddings or max_positions
    low_wavelen = old_len / rope.low_freq_factor
    high_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    blended = (1 - smooth) * scaled / rope.factor + smooth * scaled
    in_band = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(in_band, blended, scaled)


def _dynamic_angles(rope: RopeSpec, dim: int, max_positions: int, start: int, stop: int) -> torch.Tensor:
    """[stop - start, dim // 2] angles for positions past the trained length (see module doc)."""
    rows = []
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    for pos in range(start, stop):
        base = rope.theta * ((rope.factor * (pos + 1) / max_positions) - (rope.factor - 1)) ** (dim / (dim - 2))
        rows.append(float(pos) * (1.0 / (base ** exponents)))
    return torch.stack(rows)


class RotaryEmbedding(nn.Module):
    """Holds cos/sin tables [num_positions, head_dim // 2] in the model dtype."""

    def __init__(self, rope: RopeSpec, head_dim: int, max_position_embeddings: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.rope, self.head_dim, self.max_position_embeddings = rope, head_dim, max_position_embeddings
        self.cache_dtype = dtype
        self.register_buffer("cos", torch.empty(0, head_dim // 2, dtype=dtype, device=device), persistent=False)
        self.register_buffer("sin", torch.empty(0, head_dim // 2, dtype=dtype, device=device), persistent=False)
        if self.cos.device.type != "meta":
            self.build(max_position_embeddings)

    @property
    def num_positions(self) -> int:
        return self.cos.shape[0]

    def build(self, num_positions: int, device: torch.device | str | None = None) -> None:
        """(Re)compute the tables for positions [0, num_positions)."""
        device = device or self.cos.device
        positions = torch.arange(num_positions, dtype=torch.int64).float()
        inv_freq = inv_frequencies(self.rope, self.head_dim, self.max_position_embeddings)
        angles = positions[:, None] * inv_freq[None, :]
        if self.rope.rope_type == "dynamic" and num_positions > self.max_position_embeddings:
            angles[self.max_position_embeddings:] = _dynamic_angles(
                self.rope, self.head_dim, self.max_position_embeddings, self.max_position_embeddings, num_positions)
        self.cos = angles.cos().to(device=device, dtype=self.cache_dtype)
        self.sin = angles.sin().to(device=device, dtype=self.cache_dtype)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> cos, sin [T, 1, head_dim // 2] ready to broadcast over heads."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, H, D] by the half-split convention of HF Llama (same float ops in the same order)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
