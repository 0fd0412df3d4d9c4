"""Plain building blocks shared by the decoder families: RMSNorm and the gated SiLU MLP."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ecoserve.model.parallel import RowParallelLinear, TPComm


class RMSNorm(nn.Module):
    """Normalises in float32 and scales in the input dtype, as HF Llama does (bit-equal in bf16)."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)) with gate and up fused into one matmul.

    Under tensor parallelism `intermediate` is this rank's share: gate/up are column-parallel and
    down is row-parallel (one all-reduce).
    """

    def __init__(self, hidden: int, intermediate: int, bias: bool, dtype: torch.dtype | None = None,
                 tp: TPComm | None = None) -> None:
        super().__init__()
        self.intermediate = intermediate
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=bias, dtype=dtype)
        self.down_proj = RowParallelLinear(intermediate, hidden, bias, dtype, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return self.down_proj(F.silu(gate) * up)
