"""Prepacked oneDNN linear layers for float32 and bfloat16 on CPU (`--cpu-linear auto`, the default, or `onednn`).

torch's `F.linear` on CPU runs MKL's SGEMM in float32; oneDNN with the weight reordered once into
its blocked layout (what vLLM's CPU backend does) measured 2-2.5x faster on one core here (AMD
EPYC, AVX-512) at every batch size, equal within float32 rounding. In bfloat16 oneDNN picks AMX
tiles or AVX512-BF16 dot products itself (float32 accumulation, one rounding of the output), about
6x its float32 GEMM on an AMX Xeon; bf16 layers are packed only where oneDNN reports bf16 support,
since elsewhere it would emulate them. Only single-process layers are packed; a tied LM head gets
its own packed copy (the embedding keeps the plain table).
"""
from __future__ import annotations

import torch
from torch import nn

_PACK_BATCH_HINT = 128  # the batch size oneDNN's reorder tunes the layout for; any batch runs


class PackedLinear(nn.Module):
    """y = x W^T + b through oneDNN, W held in its prepacked (opaque) layout; y has x's dtype (W's)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer("packed", torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(),
                                                                                _PACK_BATCH_HINT))
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, {str(self.packed.dtype).removeprefix('torch.')} " \
               f"oneDNN prepacked"


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available()


def onednn_bf16_supported() -> bool:
    """oneDNN runs bfloat16 natively on this CPU (AVX512-BF16 or AMX; AVX-512 BW at the least)."""
    return onednn_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def packable_dtypes() -> frozenset[torch.dtype]:
    return frozenset({torch.float32, torch.bfloat16} if onednn_bf16_supported() else {torch.float32})


def pack_linears(model: nn.Module) -> int:
    """Replace every float32 CPU linear layer of `model` by a PackedLinear, and every bfloat16 one where
    oneDNN supports bf16 here; returns how many."""
    from ecoserve.model.quant import _is_linear, _replace

    dtypes = packable_dtypes()
    count = 0
    for name, module in list(model.named_modules()):
        if _is_linear(module) and module.weight.dtype in dtypes and module.weight.device.type == "cpu":
            _replace(model, name, PackedLinear(module.weight, getattr(module, "bias", None)))
            count += 1
    return count
