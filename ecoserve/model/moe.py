"""The sparse mixture-of-experts MLP (Mixtral, Qwen2-MoE, Qwen3-MoE) with grouped expert compute.

`SparseMoeBlock` replaces `DecoderLayer.mlp` in the layers `ModelSpec.moe` marks sparse. A router
picks `top_k` experts per token; `fused_experts` then sorts the (token, expert) pairs by expert,
runs one gate/up GEMM and one down GEMM per expert that received tokens (over all of its tokens
at once), scales each expert's rows by their routing weights as its down GEMM's output is written, and
adds them back into their tokens with one `index_add_`. Experts that no token picked cost nothing; no Python loop runs over tokens. On CPU
(`--cpu-linear auto|onednn`) each expert's two matrices are prepacked for oneDNN like the dense linear
layers (model/packed.py's `PackedExperts`): its AMX / AVX512-BF16 GEMM instead of torch's on plain slices.
Where the native grouped kernel runs the dtype, the experts are packed for it instead (`NativeExperts`,
kernels/moe_experts.cpp): the same computation and roundings in one call per layer.

Expert weights are stacked per layer: `w_gate_up` [E, 2I, H] (gate rows, then up rows) and
`w_down` [E, H, I], the layout of transformers' fused experts. Under tensor parallelism each rank
holds either a slice of every expert's intermediate dimension (the default, like the dense MLP)
or, with expert parallelism, whole experts [first_expert, first_expert + num_local_experts); both
give each rank a partial sum over the experts, and one all-reduce per layer completes it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ecoserve.model.fused import native_for
from ecoserve.model.parallel import Checkpointed, TPComm, checkpoint_shape, take
from ecoserve.model.spec import ModelLoadError, MoESpec

if TYPE_CHECKING:
    from ecoserve.model.packed import NativeExperts, PackedExperts


@dataclass(frozen=True)
class ExpertShard:
    """The experts one rank holds and the share of each: whole experts (expert parallel) or an intermediate slice."""

    first_expert: int
    num_local_experts: int
    intermediate: int  # this rank's rows of each held expert's intermediate dimension
    intermediate_start: int

    @classmethod
    def of(cls, moe: MoESpec, tp_size: int = 1, tp_rank: int = 0, expert_parallel: bool = False) -> "ExpertShard":
        if expert_parallel:
            if moe.num_experts % tp_size:
                raise ModelLoadError(f"--enable-expert-parallel splits the {moe.num_experts} experts over "
                                     f"tensor_parallel_size {tp_size} ranks, which must divide them")
            local = moe.num_experts // tp_size
            return cls(tp_rank * local, local, moe.intermediate_size, 0)
        if moe.intermediate_size % tp_size:
            raise ModelLoadError(f"tensor_parallel_size {tp_size} must divide the experts' intermediate size "
                                 f"{moe.intermediate_size} (or use --enable-expert-parallel)")
        inter = moe.intermediate_size // tp_size
        return cls(0, moe.num_experts, inter, tp_rank * inter)


def route(router_logits: torch.Tensor, top_k: int, normalize: bool,
          weight_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] in `weight_dtype`, expert ids [T, k] int64) as transformers' routers compute them:
    softmax in float32, top-k, optional renormalisation, then the cast. On CPU one native pass per row
    (fused_ops' `moe_route`: its exponential and sums may differ from torch's in the last float32 bit)
    replaces the five torch ops, 40 us a layer at batch 1."""
    native = native_for(router_logits)
    if native is not None and router_logits.dim() == 2 and router_logits.is_contiguous() \
            and weight_dtype in (torch.float32, torch.bfloat16):
        return tuple(native.moe_route(router_logits, top_k, normalize, weight_dtype == torch.bfloat16))
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if normalize:
        weights /= weights.sum(dim=-1, keepdim=True)
    return weights.to(weight_dtype), ids


def _silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    native = native_for(gate_up)
    if native is not None and gate_up.is_contiguous():
        return native.silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def fused_experts(x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor,
                  w_gate_up: torch.Tensor | Sequence[torch.Tensor], w_down: torch.Tensor | Sequence[torch.Tensor],
                  first_expert: int = 0,
                  linear: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = F.linear) -> torch.Tensor:
    """sum over k of weights[t, k] * expert_{ids[t, k]}(x[t]) -> [T, H] in x's dtype.

    `w_gate_up` [E_local, 2I, H], `w_down` [E_local, H, I] hold experts [first_expert, first_expert + E_local),
    stacked plain tensors for `F.linear`, or per-expert oneDNN-packed weights with their `linear`
    (model/packed.py's `PackedExperts.gate_up`, `.down`, `.linear`);
    pairs routed to other experts contribute nothing here (another rank adds them). Each row is
    scaled in the weights' dtype and rounded to x's dtype before the sum, as transformers does.
    """
    top_k, num_local = expert_ids.shape[1], len(w_gate_up)
    out = torch.zeros_like(x)
    local = expert_ids.flatten() - first_expert
    key = torch.where((local >= 0) & (local < num_local), local, num_local)  # another rank's: sorted last
    counts = torch.bincount(key, minlength=num_local + 1)[:num_local]
    order = torch.argsort(key, stable=True)  # pairs grouped by expert, in token order within each
    counts_list = counts.tolist()
    order = order[:sum(counts_list)]
    if order.numel() == 0:
        return out
    tokens = order // top_k
    rows = x.index_select(0, tokens)
    scale = weights.flatten().index_select(0, order).unsqueeze(1)
    y = torch.empty_like(rows)
    start = 0
    for expert, count in enumerate(counts_list):
        if count:
            hidden = _silu_and_mul(linear(rows[start:start + count], w_gate_up[expert]))
            # the routing-weight scale while the rows are in cache: computed in the promoted dtype, rounded
            # once to x's dtype as it is written into place for the one scatter-add below
            torch.mul(linear(hidden, w_down[expert]), scale[start:start + count], out=y[start:start + count])
            start += count
    return out.index_add_(0, tokens, y)


class Router(nn.Module):
    """The router's logits x W^T [T, E] in the model's dtype, as transformers computes them. Not an nn.Linear,
    so weight quantization leaves it alone (int8 router weights would change which experts run); on CPU
    model/packed.py's `pack_linears` sets `prepacked`, the same weight prepacked like the dense layers, whose GEMM
    differs from torch's only in the float32 accumulation order (torch's bfloat16 `F.linear` of one row took
    ~85 us a layer inside a decode step, the packed one ~20 us)."""

    def __init__(self, hidden: int, num_experts: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden, dtype=dtype))
        self.prepacked: nn.Module | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight) if self.prepacked is None else self.prepacked(x)


class SparseMoeBlock(nn.Module):
    """Router + routed experts (+ Qwen2-MoE's gated shared expert); `forward` maps [T, H] -> [T, H]."""

    def __init__(self, hidden: int, moe: MoESpec, dtype: torch.dtype, tp: TPComm | None = None,
                 expert_parallel: bool = False) -> None:
        super().__init__()
        self.moe, self.tp = moe, tp
        self.shard = ExpertShard.of(moe, tp.size if tp else 1, tp.rank if tp else 0, expert_parallel)
        local, inter = self.shard.num_local_experts, self.shard.intermediate
        self.gate = Router(hidden, moe.num_experts, dtype)
        self.w_gate_up = nn.Parameter(torch.empty(local, 2 * inter, hidden, dtype=dtype))
        self.w_down = nn.Parameter(torch.empty(local, hidden, inter, dtype=dtype))
        self.packed_experts: PackedExperts | NativeExperts | None = None  # set by model/packed.py's pack_moe_experts
        self.shared_intermediate = 0
        if moe.shared_expert_intermediate_size:
            tp_size = tp.size if tp else 1
            if moe.shared_expert_intermediate_size % tp_size:
                raise ModelLoadError(f"tensor_parallel_size {tp_size} must divide the shared expert's "
                                     f"intermediate size {moe.shared_expert_intermediate_size}")
            self.shared_intermediate = moe.shared_expert_intermediate_size // tp_size
            self.shared_gate_up = nn.Linear(hidden, 2 * self.shared_intermediate, bias=False, dtype=dtype)
            self.shared_down = nn.Linear(self.shared_intermediate, hidden, bias=False, dtype=dtype)
            self.shared_expert_gate = nn.Linear(hidden, 1, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight_dtype = x.dtype if self.moe.weights_in_model_dtype else torch.float32
        weights, ids = route(self.gate(x), self.moe.top_k, self.moe.norm_topk_prob, weight_dtype)
        out = self.experts(x, ids, weights)
        if self.shared_intermediate:  # partial under TP like the experts: one all-reduce sums both
            shared = self.shared_down(_silu_and_mul(self.shared_gate_up(x)))
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * shared
        return out if self.tp is None else self.tp.all_reduce(out)

    expert_pool = None  # model/expert_pool.py's placement of this block's experts (--moe-resident-experts)

    def experts(self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """This rank's (partial) routed-expert output; the seam an expert pool replaces to place weights."""
        if self.expert_pool is not None:
            return self.expert_pool(x, expert_ids, weights)
        if self.packed_experts is not None:
            return self.packed_experts(x, expert_ids, weights, self.shard.first_expert)
        return fused_experts(x, expert_ids, weights, self.w_gate_up, self.w_down, self.shard.first_expert)

    def pack_experts(self, packed: PackedExperts | NativeExperts) -> None:
        """Compute with `packed` (this block's experts, packed by model/packed.py); the stacked
        parameters keep their dtype and trailing shape but no experts, so the weights are not held twice."""
        self.packed_experts = packed
        self.w_gate_up.data = self.w_gate_up.data[:0].clone()
        self.w_down.data = self.w_down.data[:0].clone()

    def unpack_experts(self) -> None:
        """Undo `pack_experts` (the expert pool moves plain stacked weights between its tiers)."""
        if self.packed_experts is not None:
            self.w_gate_up.data, self.w_down.data = self.packed_experts.unpacked()
            self.packed_experts = None

    # checkpoint names inside the block -> (our stacked parameter, which half of gate_up: 0 gate, 1 up; -1 down)
    _EXPERT_PARTS = {"w1": ("gate", 0), "gate_proj": ("gate", 0), "w3": ("up", 1), "up_proj": ("up", 1),
                     "w2": ("down", -1), "down_proj": ("down", -1)}

    def checkpoint_keys(self) -> set[str]:
        """The pieces this rank must find in a checkpoint (per-expert keys even when the file stacks them)."""
        held = range(self.shard.first_expert, self.shard.first_expert + self.shard.num_local_experts)
        keys = {"gate"} | {f"experts.{e}.{part}" for e in held for part in ("gate", "up", "down")}
        if self.shared_intermediate:
            keys |= {"shared_expert.gate", "shared_expert.up", "shared_expert.down", "shared_expert_gate"}
        return keys

    def load_checkpoint_tensor(self, name: str, tensor: Checkpointed, hf_name: str) -> set[str]:
        """Copy this rank's part of one checkpoint tensor named `name` inside the block (Mixtral's
        `experts.3.w1.weight`, Qwen's `experts.3.gate_proj.weight`, transformers 5's stacked
        `experts.gate_up_proj`, the router `gate.weight`, the shared expert's); returns the keys filled."""
        parts = name.split(".")
        shard, inter = self.shard, self.shard.intermediate
        if name == "gate.weight":
            self._copy(self.gate.weight.data, tensor, hf_name, None)
            return {"gate"}
        if name == "shared_expert_gate.weight" and self.shared_intermediate:
            self._copy(self.shared_expert_gate.weight.data, tensor, hf_name, None)
            return {"shared_expert_gate"}
        if len(parts) == 3 and parts[0] == "shared_expert" and parts[2] == "weight" and self.shared_intermediate \
                and parts[1] in ("gate_proj", "up_proj", "down_proj"):
            size, rank = self.shared_intermediate, self.tp.rank if self.tp else 0
            part = (rank * size, self.moe.shared_expert_intermediate_size)
            if parts[1] == "down_proj":
                self._copy(self.shared_down.weight.data, tensor, hf_name, (1, *part))
            else:
                half = 0 if parts[1] == "gate_proj" else 1
                target = self.shared_gate_up.weight.data.narrow(0, half * size, size)
                self._copy(target, tensor, hf_name, (0, *part))
            return {f"shared_expert.{parts[1].removesuffix('_proj')}"}
        if len(parts) == 4 and parts[0] == "experts" and parts[1].isdigit() and parts[3] == "weight" \
                and parts[2] in self._EXPERT_PARTS:
            expert, (key, half) = int(parts[1]), self._EXPERT_PARTS[parts[2]]
            if expert >= self.moe.num_experts:
                raise ModelLoadError(f"checkpoint tensor {hf_name!r} names expert {expert}, but config.json has "
                                     f"{self.moe.num_experts} experts")
            local = expert - shard.first_expert
            if not 0 <= local < shard.num_local_experts:
                return set()  # another expert-parallel rank's expert
            part = (shard.intermediate_start, self.moe.intermediate_size)
            if half < 0:
                self._copy(self.w_down.data[local], tensor, hf_name, (1, *part))
            else:
                target = self.w_gate_up.data[local].narrow(0, half * inter, inter)
                self._copy(target, tensor, hf_name, (0, *part))
            return {f"experts.{expert}.{key}"}
        if name in ("experts.gate_up_proj", "experts.down_proj"):  # all experts stacked: [E, 2I, H] / [E, H, I]
            return self._load_stacked(name == "experts.gate_up_proj", tensor, hf_name)
        raise ModelLoadError(f"checkpoint tensor {hf_name!r} does not belong to a mixture-of-experts block "
                             f"with this config.json")

    def _load_stacked(self, gate_up: bool, tensor: Checkpointed, hf_name: str) -> set[str]:
        shard, moe, hidden = self.shard, self.moe, self.gate.weight.shape[1]
        full = moe.intermediate_size
        want = (moe.num_experts, 2 * full, hidden) if gate_up else (moe.num_experts, hidden, full)
        if checkpoint_shape(tensor) != want:
            raise ModelLoadError(f"checkpoint tensor {hf_name!r} has shape {checkpoint_shape(tensor)}, "
                                 f"config.json implies {want}")
        held = take(tensor, 0, shard.first_expert, shard.num_local_experts)
        start, inter = shard.intermediate_start, shard.intermediate
        with torch.no_grad():
            if gate_up:
                self.w_gate_up.data[:, :inter].copy_(held[:, start:start + inter])
                self.w_gate_up.data[:, inter:].copy_(held[:, full + start:full + start + inter])
            else:
                self.w_down.data.copy_(held[:, :, start:start + inter])
        experts = range(shard.first_expert, shard.first_expert + shard.num_local_experts)
        return {f"experts.{e}.{part}" for e in experts for part in (("gate", "up") if gate_up else ("down",))}

    @staticmethod
    def _copy(target: torch.Tensor, tensor: Checkpointed, hf_name: str,
              part: tuple[int, int, int] | None) -> None:
        """target <- tensor, or its rows (dim 0) / columns (dim 1) [start, start + target's size) when
        `part` = (dim, start, the checkpoint's full size along dim)."""
        want = list(target.shape)
        if part is not None:
            want[part[0]] = part[2]
        shape = checkpoint_shape(tensor)
        if shape != tuple(want):
            raise ModelLoadError(f"checkpoint tensor {hf_name!r} has shape {shape}, config.json implies {tuple(want)}")
        if part is not None:
            piece = take(tensor, part[0], part[1], target.shape[part[0]])
        else:
            piece = tensor if isinstance(tensor, torch.Tensor) else tensor[:]
        with torch.no_grad():
            target.copy_(piece)
