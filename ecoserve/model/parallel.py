"""Which part of a model one rank holds, and the layers that split a matmul across tensor-parallel ranks.

A rank of a (tp x pp) instance holds the layers of its pipeline stage and, inside each, its
share of the attention heads and of the MLP's intermediate size (Megatron-style: column-parallel
QKV and gate/up, row-parallel output and down projections followed by one all-reduce). With
`tp_size == 1` every layer here is exactly the single-process one, so one model class serves all.
The communication itself is injected (`TPComm`), so nothing here imports torch.distributed.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from ecoserve.model.spec import ModelLoadError, ModelSpec


class TPComm(Protocol):
    """The collectives of one tensor-parallel group (ecoserve.distributed.comm implements it)."""

    size: int
    rank: int

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor: ...

    def gather_to_first(self, t: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's `t` on rank 0 (in rank order); None on the others."""
        ...


class StageLink(Protocol):
    """Hidden states between neighbouring pipeline stages (same tensor-parallel rank)."""

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor: ...

    def send(self, t: torch.Tensor) -> None: ...


@dataclass(frozen=True)
class ShardPlan:
    """The slice of the model one rank holds: a tensor-parallel share of the layers of one stage."""

    tp_rank: int = 0
    tp_size: int = 1
    stage: int = 0
    num_stages: int = 1
    layer_start: int = 0
    layer_end: int | None = None  # exclusive; None: to the last layer
    expert_parallel: bool = False  # MoE layers: the tensor-parallel ranks split the experts, not each expert

    @property
    def is_first_stage(self) -> bool:
        return self.stage == 0

    @property
    def is_last_stage(self) -> bool:
        return self.stage == self.num_stages - 1

    def layers(self, num_layers: int) -> range:
        return range(self.layer_start, num_layers if self.layer_end is None else self.layer_end)


def partition_layers(num_layers: int, num_stages: int, override: tuple[int, ...] | None = None) -> list[range]:
    """Layers per pipeline stage.

    Default (TD-Pipe's rule): floor(L / pp) layers each, and the remainder goes one layer each to the
    stages just *before* the last one, because the last stage also runs the final norm and the LM head.
    `override` (--pp-layer-partition) gives the count per stage explicitly.
    """
    if num_stages < 1:
        raise ValueError(f"pipeline_parallel_size must be >= 1, got {num_stages}")
    if override is not None:
        counts = list(override)
        if len(counts) != num_stages or any(c < 1 for c in counts) or sum(counts) != num_layers:
            raise ValueError(f"pp_layer_partition must give {num_stages} positive layer counts summing to the "
                             f"model's {num_layers} layers, got {list(override)}")
    else:
        if num_layers < num_stages:
            raise ValueError(f"pipeline_parallel_size {num_stages} exceeds the model's {num_layers} layers")
        base, extra = divmod(num_layers, num_stages)
        counts = [base + (num_stages - 1 - extra <= s < num_stages - 1) for s in range(num_stages)]
    bounds, start = [], 0
    for c in counts:
        bounds.append(range(start, start + c))
        start += c
    return bounds


@dataclass(frozen=True)
class HeadShard:
    """A rank's attention heads: q heads [q_start, q_start + num_heads), KV heads likewise."""

    num_heads: int
    num_kv_heads: int
    q_start: int
    kv_start: int

    @classmethod
    def of(cls, spec: ModelSpec, tp_size: int, tp_rank: int) -> "HeadShard":
        nq, nkv = spec.num_heads, spec.num_kv_heads
        if nq % tp_size:
            raise ModelLoadError(f"tensor_parallel_size {tp_size} must divide the {nq} attention heads")
        if nkv >= tp_size:
            if nkv % tp_size:
                raise ModelLoadError(f"tensor_parallel_size {tp_size} must divide the {nkv} KV heads "
                                     f"(or be a multiple of it)")
            local_kv = nkv // tp_size
            kv_start = tp_rank * local_kv
        else:  # more ranks than KV heads: each rank keeps (a replica of) the one KV head its q heads use
            if tp_size % nkv:
                raise ModelLoadError(f"tensor_parallel_size {tp_size} must be a multiple of the {nkv} KV heads "
                                     f"when it exceeds them")
            local_kv = 1
            kv_start = tp_rank // (tp_size // nkv)
        local_q = nq // tp_size
        return cls(local_q, local_kv, tp_rank * local_q, kv_start)


def padded_vocab(vocab_size: int, tp_size: int) -> int:
    """The vocabulary rounded up to a multiple of tp_size, so every rank holds an equal slice."""
    return -(-vocab_size // tp_size) * tp_size


Checkpointed = torch.Tensor  # or a safetensors slice: anything with .get_shape() and [a:b] / [:, a:b]


def take(tensor: Checkpointed, dim: int, start: int, size: int) -> torch.Tensor:
    """Rows (dim 0) or columns (dim 1) [start, start + size) of a tensor or lazy checkpoint slice."""
    if isinstance(tensor, torch.Tensor):
        return tensor.narrow(dim, start, size)
    return tensor[start:start + size] if dim == 0 else tensor[:, start:start + size]


def checkpoint_shape(tensor: Checkpointed) -> tuple[int, ...]:
    return tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else tuple(tensor.get_shape())


class RowParallelLinear(nn.Module):
    """y = x_local @ W_local^T, summed over the tensor-parallel group; the bias is added once, after the sum."""

    def __init__(self, in_local: int, out_features: int, bias: bool, dtype: torch.dtype,
                 tp: TPComm | None = None) -> None:
        super().__init__()
        self.tp = tp
        self.weight = nn.Parameter(torch.empty(out_features, in_local, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp is None:
            return F.linear(x, self.weight, self.bias)
        y = self.tp.all_reduce(F.linear(x, self.weight))
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Each rank holds rows [rank * V/tp, (rank + 1) * V/tp) of the (padded) table; lookups are summed."""

    def __init__(self, vocab_size: int, hidden: int, dtype: torch.dtype, tp: TPComm | None = None) -> None:
        super().__init__()
        self.tp = tp
        size = 1 if tp is None else tp.size
        self.num_local = padded_vocab(vocab_size, size) // size
        self.start = 0 if tp is None else tp.rank * self.num_local
        self.weight = nn.Parameter(torch.empty(self.num_local, hidden, dtype=dtype))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp is None:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        outside = (local < 0) | (local >= self.num_local)
        h = F.embedding(local.masked_fill(outside, 0), self.weight)
        h.masked_fill_(outside[:, None], 0)
        return self.tp.all_reduce(h)


class ParallelLMHead(nn.Module):
    """Vocab-parallel LM head: each rank computes its slice of the logits; rank 0 gathers them whole."""

    def __init__(self, vocab_size: int, hidden: int, dtype: torch.dtype, tp: TPComm | None = None) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        size = 1 if tp is None else tp.size
        self.weight = nn.Parameter(torch.empty(padded_vocab(vocab_size, size) // size, hidden, dtype=dtype))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """float32 logits [N, vocab_size] on tensor-parallel rank 0; None on the other ranks."""
        logits = F.linear(hidden, self.weight).float()
        if self.tp is None:
            return logits
        parts = self.tp.gather_to_first(logits)
        return None if parts is None else torch.cat(parts, dim=-1)[:, :self.vocab_size]
