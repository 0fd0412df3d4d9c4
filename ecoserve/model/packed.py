"""Prepacked oneDNN linear layers for float32 and bfloat16 on CPU (`--cpu-linear auto`, the default, or `onednn`).

torch's `F.linear` on CPU runs MKL's SGEMM in float32; oneDNN with the weight reordered once into
its blocked layout (what vLLM's CPU backend does) measured 2-2.5x faster on one core here (AMD
EPYC, AVX-512) at every batch size, equal within float32 rounding. In bfloat16 oneDNN picks AMX
tiles or AVX512-BF16 dot products itself (float32 accumulation, one rounding of the output), about
6x its float32 GEMM on an AMX Xeon; bf16 layers are packed only where oneDNN reports bf16 support,
since elsewhere it would emulate them. Only single-process layers are packed; a tied LM head gets
its own packed copy (the embedding keeps the plain table). The routed experts of a mixture-of-experts
block are packed the same way, each expert's gate/up and down matrix on its own (`PackedExperts`): in
bfloat16 always (1.3-1.6x torch's GEMM over one MoE layer here, Xeon with AMX, 1 thread), in float32 only
under `--cpu-linear onednn`, since there oneDNN's packed GEMM measured 0.8x torch's at decode-sized
groups (1-8 tokens per expert) and 1.14x at prefill-sized ones. Where the native grouped kernel
(kernels/moe_experts.cpp) builds and runs the dtype (bfloat16 where `cpublas::could_pack` says AMX,
float32 anywhere), the experts are packed for it instead (`NativeExperts`): one call per layer, not two
oneDNN calls of ~100 us fixed cost per active expert.

Decode-sized calls (at most the kernel's `max_rows(dtype)`: 8 in float32, 4 in bfloat16) read the same packed
weight through the native loop of kernels/skinny_linear.cpp, which streams it 1.2-1.35x faster than oneDNN's
GEMM at one row on an AMX Xeon; it first checks, element by element, that it reads oneDNN's layout as the weight, and
a layer whose layout it does not recognise stays on oneDNN at every size.
"""
from __future__ import annotations

import torch
from torch import nn

from ecoserve.kernels import moe_experts, paths, skinny_linear
from ecoserve.kernels.paths import onednn_available, packable_dtypes
from ecoserve.model.moe import fused_experts

_PACK_BATCH_HINT = 128  # the batch size oneDNN's reorder tunes the layout for; any batch runs


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """W [out, in] reordered once into oneDNN's blocked layout (an opaque mkldnn tensor; `to_dense` undoes it)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), _PACK_BATCH_HINT)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T (+ b) through oneDNN with W from `pack_weight`; the result has x's dtype."""
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")


def linear_packs(dtype: torch.dtype) -> bool:
    """A dense linear of `dtype` becomes a PackedLinear here: natively, or bf16 on its widened weight."""
    return dtype in packable_dtypes() or (dtype == torch.bfloat16 and paths.bf16_linear_widened())


class PackedLinear(nn.Module):
    """y = x W^T + b through oneDNN, W held in its prepacked (opaque) layout; y has x's dtype (W's). A bf16
    weight on a CPU whose oneDNN has no native bf16 is packed widened to float32 (`paths.bf16_linear_widened`)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.dtype = weight.dtype
        if weight.dtype == torch.bfloat16 and paths.bf16_linear_widened():
            weight = weight.float()
            bias = None if bias is None else bias.float()
        self.register_buffer("packed", pack_weight(weight))
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        self.skinny_rows, self.skinny_layout = 0, None  # decode rows through the native loop: how many, its layout
        kernel = skinny_linear()
        if kernel is not None and weight.dtype in (torch.float32, torch.bfloat16):
            layout = kernel.fit(self.packed, weight.detach().contiguous())
            if layout[0]:  # above max_rows oneDNN's GEMM is as fast or faster
                self.skinny_rows, self.skinny_layout = kernel.max_rows(weight.dtype), layout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed.dtype != x.dtype:  # widened: x to the packed weight's float32, the result back
            return self._forward(x.to(self.packed.dtype)).to(x.dtype)
        return self._forward(x)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.shape[0] <= self.skinny_rows:
            return skinny_linear().skinny_linear(x.contiguous(), self.packed, self.bias, self.out_features,
                                                 *self.skinny_layout)
        return packed_linear(x, self.packed, self.bias)

    def extra_repr(self) -> str:
        packed, dtype = (str(d).removeprefix("torch.") for d in (self.packed.dtype, self.dtype))
        widened = f" (a {dtype} layer, widened)" if packed != dtype else ""
        return f"in={self.in_features}, out={self.out_features}, {packed} oneDNN prepacked{widened}"


class PackedExperts(nn.Module):
    """The routed experts of one MoE block, each expert's gate/up [2I, H] and down [H, I] weight packed on its own
    (`fused_experts` runs one GEMM per active expert over its tokens, so each is a small oneDNN linear)."""

    linear = staticmethod(packed_linear)

    def __init__(self, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> None:
        super().__init__()
        self.num_experts = w_gate_up.shape[0]
        for e in range(self.num_experts):
            self.register_buffer(f"gate_up_{e}", pack_weight(w_gate_up[e]))
            self.register_buffer(f"down_{e}", pack_weight(w_down[e]))
        # the same tensors as lists, indexed by local expert (opaque oneDNN tensors never move off the CPU)
        self.gate_up = [getattr(self, f"gate_up_{e}") for e in range(self.num_experts)]
        self.down = [getattr(self, f"down_{e}") for e in range(self.num_experts)]

    def forward(self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor,
                first_expert: int = 0) -> torch.Tensor:
        return fused_experts(x, expert_ids, weights, self.gate_up, self.down, first_expert, self.linear)

    def unpacked(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The stacked plain weights (w_gate_up [E, 2I, H], w_down [E, H, I]) back, bit for bit."""
        return (torch.stack([w.to_dense() for w in self.gate_up]), torch.stack([w.to_dense() for w in self.down]))

    def extra_repr(self) -> str:
        return f"experts={self.num_experts}, {str(self.gate_up_0.dtype).removeprefix('torch.')} oneDNN prepacked"


class NativeExperts(nn.Module):
    """The routed experts of one MoE block packed once for the native grouped kernel (kernels/moe_experts.cpp):
    each matrix in blocks of 64 output columns in the layout PyTorch's brgemm micro-kernels read, and one call
    per layer computes every active expert (`fused_experts`' result, as the same roundings give)."""

    def __init__(self, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> None:
        super().__init__()
        kernel = moe_experts()
        self.num_experts, two_inter, self.hidden = w_gate_up.shape
        self.inter = two_inter // 2
        gate, up = (w.contiguous() for w in w_gate_up.detach().split(self.inter, dim=1))
        # the gate's column blocks, then the up's: a tile's two GEMMs read matching blocks of each
        self.register_buffer("gate_up", torch.cat([kernel.pack_experts(gate), kernel.pack_experts(up)], dim=1))
        self.register_buffer("down", kernel.pack_experts(w_down.detach().contiguous()))

    supports = staticmethod(paths.native_experts)

    def forward(self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor,
                first_expert: int = 0) -> torch.Tensor:
        return moe_experts().moe_experts(x, expert_ids, weights, self.gate_up, self.down, self.inter, first_expert)

    def unpacked(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The stacked plain weights (w_gate_up [E, 2I, H], w_down [E, H, I]) back, bit for bit."""
        kernel, half = moe_experts(), self.gate_up.shape[1] // 2
        gate, up = (kernel.unpack_experts(p.contiguous(), self.inter, self.hidden) for p in self.gate_up.split(half, 1))
        return torch.cat([gate, up], dim=1), kernel.unpack_experts(self.down, self.hidden, self.inter)

    def extra_repr(self) -> str:
        return f"experts={self.num_experts}, {str(self.down.dtype).removeprefix('torch.')} packed for brgemm"


def pack_linears(model: nn.Module) -> int:
    """Replace every float32 and bfloat16 CPU linear layer of `model` by a PackedLinear (bfloat16 widened where
    oneDNN has no native bf16 here), MoE routers included (they keep their plain weight beside the packed one);
    returns how many. (MoE experts: `pack_moe_experts`.)"""
    from ecoserve.model.moe import Router
    from ecoserve.model.quant import _is_linear, _replace

    count = 0
    for name, module in list(model.named_modules()):
        router = isinstance(module, Router)
        if (router or _is_linear(module)) and linear_packs(module.weight.dtype) and module.weight.device.type == "cpu":
            if router:
                module.prepacked = PackedLinear(module.weight, None)
            else:
                _replace(model, name, PackedLinear(module.weight, getattr(module, "bias", None)))
            count += 1
    return count


def pack_moe_experts(model: nn.Module, float32: bool = False) -> int:
    """Prepack the routed experts of every CPU MoE block of `model` for the native grouped kernel where it runs
    their dtype; otherwise for oneDNN: in bfloat16 where oneDNN has bf16 here, in float32 too when `float32`
    (`--cpu-linear onednn`; see above for why not by default). Returns how many blocks."""
    from ecoserve.model.moe import SparseMoeBlock

    dtypes = packable_dtypes() if float32 else packable_dtypes() - {torch.float32}
    blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock) and m.w_gate_up.device.type == "cpu"
              and m.w_gate_up.numel() and (m.w_gate_up.dtype in dtypes or NativeExperts.supports(m.w_gate_up.dtype))]
    for block in blocks:
        kind = NativeExperts if NativeExperts.supports(block.w_gate_up.dtype) else PackedExperts
        block.pack_experts(kind(block.w_gate_up.data, block.w_down.data))
    return len(blocks)
