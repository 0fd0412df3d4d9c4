"""Weight-only quantized layers: GGUF Q4_0 / Q4_1 / Q8_0 blocks kept as stored, float32 activations.

A quantized weight is a uint8 parameter [out_features, in_features / 32 * block_bytes] holding the
GGUF blocks row by row, so fused projections (qkv, gate_up) are row slices of one tensor and the
loader copies blocks like any other tensor. Small batches (decode) run the native integer kernel;
large ones (prefill) dequantize the layer once per call and use torch's float GEMM, which is
faster there. Without the native kernel, every call dequantizes with torch.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ecoserve.model.spec import ModelLoadError

BLOCK = 32


@dataclass(frozen=True)
class QuantType:
    name: str
    ggml_type: int  # GGML's type id, as GGUF files store it
    block_bytes: int


QUANT_TYPES = {q.ggml_type: q for q in (QuantType("Q4_0", 2, 18), QuantType("Q4_1", 3, 20),
                                        QuantType("Q8_0", 8, 34))}
# Rows up to this many use the integer kernel; above it, dequantize + float GEMM. Measured (one thread,
# AVX512-VNNI path, Intel Xeon): a 3072x576 Q4_1 layer takes 0.69 ms in the kernel at 16 rows against
# 1.56 ms to dequantize and multiply, 1.41 against 1.79 at 32, and loses at 64 (3.26 against 2.28); a
# 2048x768 Q8_0 layer 1.01 against 1.17 at 32 rows, 2.05 against 1.59 at 64.
MAX_KERNEL_ROWS = 32


@functools.lru_cache(maxsize=1)
def _native():
    from ecoserve.kernels import quant_matmul

    return quant_matmul()


def row_bytes(ggml_type: int, in_features: int) -> int:
    return in_features // BLOCK * QUANT_TYPES[ggml_type].block_bytes


def dequantize_torch(w: torch.Tensor, ggml_type: int, in_features: int) -> torch.Tensor:
    """uint8 blocks [N, row_bytes] -> float32 [N, in_features] with torch ops (the reference and fallback)."""
    blocks = w.reshape(w.shape[0], in_features // BLOCK, QUANT_TYPES[ggml_type].block_bytes)
    d = blocks[..., 0:2].contiguous().view(torch.float16).float()
    if ggml_type == 8:
        q = blocks[..., 2:].contiguous().view(torch.int8).float()
        return (d * q).reshape(w.shape[0], in_features)
    qs = blocks[..., 4:] if ggml_type == 3 else blocks[..., 2:]
    q = torch.cat([qs & 0x0F, qs >> 4], dim=-1).float()
    m = blocks[..., 2:4].contiguous().view(torch.float16).float() if ggml_type == 3 else -8 * d
    return (d * q + m).reshape(w.shape[0], in_features)


def dequantize(w: torch.Tensor, ggml_type: int, in_features: int) -> torch.Tensor:
    native = _native()
    if native is not None:
        return native.dequantize(w, ggml_type, in_features)
    return dequantize_torch(w, ggml_type, in_features)


def quantize_q8_0(w: torch.Tensor) -> torch.Tensor:
    """float [N, K] -> Q8_0 blocks [N, K / 32 * 34] (scale max|w| / 127 per 32 weights, as GGUF's Q8_0)."""
    n, k = w.shape
    blocks = w.float().reshape(n, k // BLOCK, BLOCK)
    d = blocks.abs().amax(-1, keepdim=True) / 127
    q = torch.where(d > 0, blocks / d, torch.zeros_like(blocks)).round().clamp(-127, 127).to(torch.int8)
    scale = d.to(torch.float16).view(torch.uint8).reshape(n, k // BLOCK, 2)
    return torch.cat([scale, q.view(torch.uint8)], dim=-1).reshape(n, -1)


class QuantLinear(nn.Module):
    """nn.Linear with a block-quantized weight; float32 in, float32 out."""

    def __init__(self, in_features: int, out_features: int, ggml_type: int, bias: bool = False) -> None:
        super().__init__()
        if in_features % BLOCK:
            raise ModelLoadError(f"quantized layers need in_features divisible by {BLOCK}, got {in_features}")
        self.in_features, self.out_features, self.ggml_type = in_features, out_features, ggml_type
        self.weight = nn.Parameter(torch.empty(out_features, row_bytes(ggml_type, in_features), dtype=torch.uint8),
                                   requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    @classmethod
    def from_linear(cls, linear: nn.Module) -> QuantLinear:
        """Q8_0 copy of a float linear layer (`--quantization int8`)."""
        out_features, in_features = linear.weight.shape
        bias = getattr(linear, "bias", None)
        q = cls(in_features, out_features, 8, bias is not None)
        q.weight = nn.Parameter(quantize_q8_0(linear.weight.data), requires_grad=False)
        if bias is not None:
            q.bias = nn.Parameter(bias.data.float(), requires_grad=False)
        return q

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        native = _native()
        if native is not None and flat.shape[0] <= MAX_KERNEL_ROWS:
            out = native.quant_linear(flat.float(), self.weight, self.ggml_type)
            if self.bias is not None:
                out += self.bias
        else:
            out = F.linear(flat.float(), dequantize(self.weight, self.ggml_type, self.in_features), self.bias)
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, {QUANT_TYPES[self.ggml_type].name}"


class QuantEmbedding(nn.Module):
    """nn.Embedding with block-quantized rows: looks up the rows' blocks and dequantizes only those."""

    def __init__(self, num_embeddings: int, dim: int, ggml_type: int) -> None:
        super().__init__()
        if dim % BLOCK:
            raise ModelLoadError(f"quantized embeddings need a dimension divisible by {BLOCK}, got {dim}")
        self.dim, self.ggml_type = dim, ggml_type
        self.weight = nn.Parameter(torch.empty(num_embeddings, row_bytes(ggml_type, dim), dtype=torch.uint8),
                                   requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.weight.index_select(0, ids.reshape(-1))
        return dequantize(rows, self.ggml_type, self.dim).reshape(*ids.shape, self.dim)


def module_of(hf_name: str) -> str:
    """HF tensor name -> our module holding it: 'model.layers.0.self_attn.q_proj.weight' -> 'layers.0.self_attn.qkv_proj'."""
    from ecoserve.model.llama import LlamaModel

    parts = hf_name.removeprefix("model.").split(".")[:-1]
    if parts and parts[-1] in LlamaModel._FUSED:
        parts[-1] = LlamaModel._FUSED[parts[-1]][0]
    return ".".join(parts)


def _is_embedding(module: nn.Module) -> bool:
    from ecoserve.model.parallel import VocabParallelEmbedding

    return isinstance(module, (nn.Embedding, VocabParallelEmbedding))


def _is_linear(module: nn.Module) -> bool:
    """nn.Linear and the single-process forms of the parallel layers (y = x W^T + b, W [out, in])."""
    from ecoserve.model.parallel import ParallelLMHead, RowParallelLinear

    return isinstance(module, (nn.Linear, RowParallelLinear, ParallelLMHead)) and getattr(module, "tp", None) is None


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, attr, new)


def quantize_model_modules(model: nn.Module, types: dict[str, int]) -> list[str]:
    """Replace (on the meta device) the modules named in `types` by quantized ones; returns their names.

    `types` maps a module name ("layers.0.self_attn.qkv_proj", "embed_tokens", "lm_head") to a GGML type.
    """
    for name, ggml_type in types.items():
        old = model.get_submodule(name)
        out_features, in_features = old.weight.shape
        if _is_embedding(old) and getattr(old, "tp", None) is None:
            new = QuantEmbedding(out_features, in_features, ggml_type)
        elif _is_linear(old):
            new = QuantLinear(in_features, out_features, ggml_type, getattr(old, "bias", None) is not None)
        else:
            raise TypeError(f"{name} is a {type(old).__name__}; only single-process linear and embedding "
                            f"layers can be quantized")
        _replace(model, name, new)
    return list(types)


def quantize_linears_int8(model: nn.Module) -> int:
    """`--quantization int8`: every linear layer whose input width is a multiple of 32 becomes Q8_0
    (the embedding stays float; a tied LM head gets its own Q8_0 copy)."""
    count = 0
    for name, module in list(model.named_modules()):
        if _is_linear(module) and module.weight.shape[1] % BLOCK == 0:
            _replace(model, name, QuantLinear.from_linear(module))
            count += 1
    return count


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters and buffers, each storage counted once (tied weights once)."""
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        if t.is_mkldnn:  # an opaque prepacked weight (ecoserve.model.packed): no storage to share
            total += t.numel() * t.element_size()
            continue
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


def describe_weights(model: nn.Module) -> str:
    """'Q4_1 x210, Q8_0 x2, float32 x61': how many weight tensors of each kind (for the start-up log)."""
    counts: dict[str, int] = {}
    for module in model.modules():
        if isinstance(module, (QuantLinear, QuantEmbedding)):
            kind = QUANT_TYPES[module.ggml_type].name
        elif type(module).__name__ == "W8A8Linear":
            kind = "int8 W8A8"
        elif hasattr(module, "packed"):
            kind = f"{str(module.packed.dtype).removeprefix('torch.')} oneDNN-packed"
        elif _is_linear(module) or _is_embedding(module):
            kind = str(module.weight.dtype).removeprefix("torch.")
        else:
            continue
        counts[kind] = counts.get(kind, 0) + 1
    return ", ".join(f"{k} x{n}" for k, n in sorted(counts.items()))
