"""W8A8 linear layers (`--quantization w8a8`): int8 weights with one scale per output channel, int8
activations with one scale per token computed at run time, and an int8 x int8 -> int32 GEMM.

The GEMM is oneDNN's int8 matmul through torch (`torch.ops.onednn.qlinear_pointwise` on a weight
prepacked once by `qlinear_prepack`): AMX-INT8 tiles or AVX512-VNNI / AVX-VNNI dot products where the
CPU has them. oneDNN applies the per-channel weight scales; torch's wrapper takes one activation scale
per tensor only, so the GEMM runs with scale 1 and the native `quant_matmul` kernel applies the
per-token scales (and the bias) in one pass over the output, after rounding the activations in one
pass over the input. Without oneDNN the GEMM is `torch._int_mm` on the plain int8 weight; without
the native kernel, torch ops do the float passes (the same rounding, bit for bit).

Where it pays: compute-bound batches (prefill, offline throughput), where the int8 GEMM does several
times the float32 GEMM's multiply-adds per second. Batch-1 decode is memory-bound and gains more
from `--quantization int8`'s Q8_0 block kernel (model/quant.py), which reads a quarter of float32's bytes.
"""
from __future__ import annotations

import functools
import logging

import torch
from torch import nn

logger = logging.getLogger(__name__)

# the CPU features with which oneDNN's int8 GEMM multiplies int8 in hardware (else it widens to int16/32)
INT8_DOT_FLAGS = ("amx_int8", "avx512_vnni", "avx_vnni")


@functools.lru_cache(maxsize=1)
def _native():
    from ecoserve.kernels import quant_matmul

    return quant_matmul()


def quantize_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float [N, K] -> (int8 [N, K], float32 [N]): each output channel rounded with scale max|w_n| / 127."""
    w = w.float()
    scale = w.abs().amax(1) / 127
    inv = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
    return torch.round(w * inv[:, None]).clamp(-127, 127).to(torch.int8), scale


def quantize_per_token_torch(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 [M, K] -> (int8 [M, K], float32 [M]) with torch ops: the reference and the fallback."""
    scale = x.abs().amax(1) / 127
    inv = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
    return torch.round(x * inv[:, None]).to(torch.int8), scale


class W8A8Linear(nn.Module):
    """nn.Linear with an int8 weight [out, in] and per-output-channel scales. Takes float32 or bfloat16 rows and
    returns their dtype: the scaling and the bias are applied in float32 and a bfloat16 output rounded once.

    `weight` is the plain int8 matrix, or, once `pack()` ran, oneDNN's opaque prepacked copy of it.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=torch.int8), requires_grad=False)
        self.weight_scale = nn.Parameter(torch.empty(out_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.packed = False

    @classmethod
    def from_linear(cls, linear: nn.Module) -> W8A8Linear:
        out_features, in_features = linear.weight.shape
        bias = getattr(linear, "bias", None)
        layer = cls(in_features, out_features, bias is not None)
        q, scale = quantize_per_channel(linear.weight.data)
        layer.weight = nn.Parameter(q, requires_grad=False)
        layer.weight_scale = nn.Parameter(scale, requires_grad=False)
        if bias is not None:
            layer.bias = nn.Parameter(bias.data.float(), requires_grad=False)
        return layer

    def pack(self) -> None:
        """Reorder the weight once into oneDNN's blocked layout (any batch size; the plain copy is dropped)."""
        self.weight = nn.Parameter(torch.ops.onednn.qlinear_prepack(self.weight.data, None), requires_grad=False)
        self._zero_points = torch.zeros(self.out_features, dtype=torch.int64)
        self.packed = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        native = _native()
        xq, x_scale = native.quantize_per_token(flat) if native is not None else quantize_per_token_torch(flat.float())
        if self.packed:
            out = torch.ops.onednn.qlinear_pointwise(xq, 1.0, 0, self.weight, self.weight_scale, self._zero_points,
                                                     None, 1.0, 0, torch.float32, "none", [], "")
        else:
            out = torch._int_mm(xq, self.weight.t()).float() * self.weight_scale
        if native is not None:  # the per-token scales, the bias and the rounding to x's dtype in one pass
            result = out if x.dtype == torch.float32 else torch.empty_like(out, dtype=x.dtype)
            native.scale_rows_to(out, x_scale, self.bias, result)
        else:
            out *= x_scale[:, None]
            if self.bias is not None:
                out += self.bias
            result = out.to(x.dtype)
        return result.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        how = "oneDNN-packed" if self.packed else "torch._int_mm"
        return f"in={self.in_features}, out={self.out_features}, int8 per-channel x int8 per-token, {how}"


def quantize_linears_w8a8(model: nn.Module) -> int:
    """`--quantization w8a8`: every single-process linear layer (the LM head included; a tied one gets its
    own int8 copy, the embedding stays float) becomes a W8A8Linear. Returns how many."""
    from ecoserve.kernels import cpu_flags
    from ecoserve.model.quant import _is_linear, _replace

    if not any(flag in cpu_flags() for flag in INT8_DOT_FLAGS):
        logger.warning("--quantization w8a8: this CPU has no int8 dot-product instructions (%s); the int8 GEMM "
                       "runs, slower than on a CPU with them", ", ".join(INT8_DOT_FLAGS))
    from ecoserve.model.packed import onednn_available

    pack = onednn_available()
    count = 0
    for name, module in list(model.named_modules()):
        if _is_linear(module):
            layer = W8A8Linear.from_linear(module)
            if pack:
                layer.pack()
            _replace(model, name, layer)
            count += 1
    return count
