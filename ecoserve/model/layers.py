"""Plain building blocks shared by the decoder families: RMSNorm and the gated SiLU MLP."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ecoserve.model.fused import native_for
from ecoserve.model.parallel import RowParallelLinear, TPComm


class RMSNorm(nn.Module):
    """Normalises in float32 and scales in the input dtype, as HF Llama does (bit-equal in bf16)."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        native = native_for(x)
        if native is not None and x.is_contiguous() and self.weight.dtype == x.dtype:
            return native.rms_norm(x, self.weight, self.eps)
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
        gate_up = self.gate_up_proj(x)
        native = native_for(gate_up)
        if native is not None and gate_up.is_contiguous():
            return self.down_proj(native.silu_and_mul(gate_up))
        gate, up = gate_up.split(self.intermediate, dim=-1)
        return self.down_proj(F.silu(gate) * up)
