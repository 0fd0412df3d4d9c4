"""W8A8 linear layers (`--quantization w8a8`): int8 weights with one scale per output channel, int8
activations with one scale per token computed at run time, and an int8 x int8 -> int32 GEMM.

The GEMM is oneDNN's int8 matmul through torch (`torch.ops.onednn.qlinear_pointwise` on a weight
prepacked once by `qlinear_prepack`) where the CPU has int8 dot products (AMX-INT8 tiles, AVX512-VNNI or
AVX-VNNI; `paths.w8a8_onednn`). Without them oneDNN's x86 kernels sum pairs of products in int16 and
saturate, so there the weight stays plain and the native `quant_matmul.int8_gemm` multiplies it exactly
(AVX2 maddubs on |w| and x with w's sign, which cannot saturate), or `torch._int_mm` without the native
kernel. oneDNN applies the per-channel weight scales; torch's wrapper takes one activation scale per
tensor only, so the GEMM runs with scale 1 and the native `quant_matmul` kernel applies the per-token
scales (and the bias) in one pass over the output, after rounding the activations in one pass over the
input; without the native kernel, torch ops do the float passes (the same rounding, bit for bit).

Where it pays: compute-bound batches (prefill, offline throughput), where the int8 GEMM does several
times the float32 GEMM's multiply-adds per second. Batch-1 decode is memory-bound and gains more
from `--quantization int8`'s Q8_0 block kernel (model/quant.py), which reads a quarter of float32's bytes.
The LM head stays float unless asked (`--quantize-lm-head`), as vLLM's W8A8 checkpoints keep it.
"""
from __future__ import annotations

import functools
import logging

import torch
from torch import nn

from ecoserve.kernels import paths

logger = logging.getLogger(__name__)

LM_HEAD = "lm_head"  # the LM head's module name in every model (model/llama.py)


@functools.lru_cache(maxsize=1)
def _native():
    from ecoserve.kernels import quant_matmul

    return quant_matmul()


def _onednn_refusal() -> str:
    """Why W8A8 may not use oneDNN's int8 GEMM here (where `paths.w8a8_onednn()` is False)."""
    if not paths.onednn_available():
        return "torch has no oneDNN"
    return "this CPU has no int8 dot-product instructions (VNNI, AMX-INT8), so oneDNN's int16 pair sums would saturate"


def int8_matmul(xq: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """int8 [M, K] @ int8 [N, K]^T -> int32 [M, N], exact on every CPU: the native kernel (25-35x faster than
    `torch._int_mm` on the AVX2 EPYC of docs/benchmarks.md), else `torch._int_mm`. `xq` within +/-127, as the
    per-token rounding writes it."""
    native = _native()
    return native.int8_gemm(xq, w) if native is not None else torch._int_mm(xq, w.t())


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
        """Reorder the weight once into oneDNN's blocked layout (any batch size; the plain copy is dropped).
        Refused where `paths.w8a8_onednn()` says no: there oneDNN's int8 GEMM gives wrong sums."""
        if not paths.w8a8_onednn():
            raise ValueError(f"W8A8Linear.pack: oneDNN's int8 GEMM is refused here: {_onednn_refusal()}; the "
                             f"layer stays unpacked, on the exact int8 GEMM")
        self.weight = nn.Parameter(torch.ops.onednn.qlinear_prepack(self.weight.data, None), requires_grad=False)
        self._zero_points = torch.zeros(self.out_features, dtype=torch.int64)
        self.packed = True

    def gemm(self, xq: torch.Tensor) -> torch.Tensor:
        """The layer's int8 GEMM on rounded activations [M, K]: the exact int32 sums, or once packed oneDNN's
        float32 with the weight scales applied (torch's wrapper returns no int32)."""
        if self.packed:
            return torch.ops.onednn.qlinear_pointwise(xq, 1.0, 0, self.weight, self.weight_scale, self._zero_points,
                                                      None, 1.0, 0, torch.float32, "none", [], "")
        return int8_matmul(xq, self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        native = _native()
        xq, x_scale = native.quantize_per_token(flat) if native is not None else quantize_per_token_torch(flat.float())
        out = self.gemm(xq)
        w_scale = None if self.packed else self.weight_scale
        if native is not None:  # the scales, the bias and the rounding to x's dtype in one pass
            result = out if out.dtype == x.dtype else torch.empty_like(out, dtype=x.dtype)
            native.scale_rows_to(out, x_scale, self.bias, result, w_scale)
        else:
            out = out.float()
            if w_scale is not None:
                out *= w_scale
            out *= x_scale[:, None]
            if self.bias is not None:
                out += self.bias
            result = out.to(x.dtype)
        return result.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        how = "oneDNN-packed" if self.packed else "native int8 GEMM" if _native() is not None else "torch._int_mm"
        return f"in={self.in_features}, out={self.out_features}, int8 per-channel x int8 per-token, {how}"


def quantize_linears_w8a8(model: nn.Module, lm_head: bool = False) -> int:
    """`--quantization w8a8`: every single-process linear layer becomes a W8A8Linear, the LM head only with
    `lm_head` (`--quantize-lm-head`; a tied one then gets its own int8 copy, the embedding stays float).
    Returns how many."""
    from ecoserve.model.quant import _is_linear, _replace

    pack = paths.w8a8_onednn()
    gemm = "the native int8 GEMM" if _native() is not None else "torch._int_mm"
    logger.info("--quantization w8a8: int8 GEMM through %s", "oneDNN's prepacked int8 matmul (int8 dot products "
                "in hardware)" if pack else f"{gemm}, exact ({_onednn_refusal()})")
    count = 0
    for name, module in list(model.named_modules()):
        if _is_linear(module) and (lm_head or name.rpartition(".")[2] != LM_HEAD):
            layer = W8A8Linear.from_linear(module)
            if pack:
                layer.pack()
            _replace(model, name, layer)
            count += 1
    return count
