"""Batched heterogeneous LoRA: each wrapped linear adds its rows' `x @ A_slot^T @ B_slot^T` per adapter slot.

Adapters live in a fixed pool of `max_loras` slots per wrapped module (A: [slots, n_slices * max_rank, in],
B^T per output slice: [slots, max_rank, out]), so shapes never change while adapters come and go. A step's
tokens are grouped by slot (Punica's SGMV idea, on CPU): per active slot one shrink GEMM over its rows and
one expand GEMM per output slice, using only the slot's own rank. A slot whose rows are one contiguous run
is read and updated in place through views; otherwise its rows are gathered and scattered back with
`index_add_`. Rows of the base model pay nothing, and a step without adapters costs one attribute test.

The model's modules are wrapped after loading (`wrap_model`); the wrapped base may be an `nn.Linear`, a
prepacked oneDNN linear or a quantized one: it is only called.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch
from torch import nn

from ecoserve.lora.checkpoint import FUSED_SLICES, LoRATargets, ModuleShape


@dataclass
class Segment:
    """The rows of one slot in this step: a contiguous run (a slice) or gathered row indices."""

    slot: int
    rank: int
    rows: slice | torch.Tensor


@dataclass
class LoRAStep:
    """What every wrapped module reads during one forward pass, set by the model runner's call of
    `LoRAManager.begin_step`: the step's segments and how many layers of each slot are resident."""

    num_slots: int
    segments: list[Segment] = field(default_factory=list)
    ready: list[int] = field(default_factory=list)  # per slot: layers whose weights are in place
    failed: list[BaseException | None] = field(default_factory=list)  # per slot: the load's error
    layer_events: list[list] = field(default_factory=list)  # per slot, per layer: a CUDA event (GPU loads)
    changed: threading.Condition = field(default_factory=threading.Condition)

    def __post_init__(self) -> None:
        self.ready = [0] * self.num_slots
        self.failed = [None] * self.num_slots
        self.layer_events = [[] for _ in range(self.num_slots)]

    def wait(self, slot: int, layer: int) -> None:
        """Block until layer `layer` of `slot` is resident (the loader runs ahead on its own thread)."""
        if self.ready[slot] <= layer:
            with self.changed:
                while self.ready[slot] <= layer and self.failed[slot] is None:
                    self.changed.wait()
            error = self.failed[slot]
            if error is not None and self.ready[slot] <= layer:
                raise RuntimeError(f"loading the LoRA adapter of slot {slot} failed: {error}") from error
        events = self.layer_events[slot]
        if events:  # a GPU: the compute stream waits for the copy stream's event of this layer only
            torch.cuda.current_stream().wait_event(events[layer])


class LoRALinear(nn.Module):
    """A base linear plus the LoRA of whichever slot each row's request uses."""

    def __init__(self, base: nn.Module, layer: int, shape: ModuleShape, num_slots: int, max_rank: int,
                 dtype: torch.dtype, device: torch.device, step: LoRAStep) -> None:
        super().__init__()
        self.base, self.layer, self.step = base, layer, step
        n = len(shape.slice_sizes)
        self.slice_sizes = shape.slice_sizes
        self.offsets = [sum(shape.slice_sizes[:i]) for i in range(n)]
        self.out_features = sum(shape.slice_sizes)
        self.register_buffer("lora_a", torch.zeros(num_slots, n * max_rank, shape.in_features, dtype=dtype,
                                                   device=device), persistent=False)
        for i, size in enumerate(shape.slice_sizes):
            self.register_buffer(f"lora_bt{i}", torch.zeros(num_slots, max_rank, size, dtype=dtype, device=device),
                                 persistent=False)
        self.lora_bt = [getattr(self, f"lora_bt{i}") for i in range(n)]
        # per slot: which output slices the slot's adapter adapts (none: the module is skipped for it)
        self.present: list[tuple[bool, ...]] = [(False,) * n for _ in range(num_slots)]

    def load_slot(self, slot: int, weights: tuple[torch.Tensor, list[torch.Tensor | None]] | None, rank: int,
                  non_blocking: bool = False) -> None:
        """Copy one adapter's weights of this module into `slot` (None: the adapter does not adapt it)."""
        if weights is None:
            self.present[slot] = (False,) * len(self.lora_bt)
            return
        a, bts = weights
        self.lora_a[slot, :a.shape[0]].copy_(a, non_blocking=non_blocking)
        for dst, bt in zip(self.lora_bt, bts):
            if bt is not None:
                dst[slot, :rank].copy_(bt, non_blocking=non_blocking)
        self.present[slot] = tuple(bt is not None for bt in bts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        segments = self.step.segments
        if not segments:
            return y
        step, layer = self.step, self.layer
        for seg in segments:
            slot = seg.slot
            step.wait(slot, layer)
            present = self.present[slot]
            if not any(present):
                continue
            r = seg.rank
            a = self.lora_a[slot, :len(present) * r]
            rows = seg.rows
            if isinstance(rows, slice):  # one contiguous run: updated in place
                xs, target = x[rows], y[rows]
            else:
                xs = x.index_select(0, rows)
                target = torch.zeros(xs.shape[0], self.out_features, dtype=y.dtype, device=y.device)
            h = torch.mm(xs, a.t())
            for i, bt in enumerate(self.lora_bt):
                if present[i]:
                    o = self.offsets[i]
                    target[:, o:o + self.slice_sizes[i]].addmm_(h[:, i * r:(i + 1) * r], bt[slot, :r])
            if not isinstance(rows, slice):
                y.index_add_(0, rows, target)
        return y

    def extra_repr(self) -> str:
        return f"layer={self.layer}, slots={self.lora_a.shape[0]}, max_rank={self.lora_bt[0].shape[1]}, " \
               f"slices={self.slice_sizes}"


def model_targets(model: nn.Module, model_name: str) -> LoRATargets:
    """The wrappable modules of a built Llama-family model and their shapes (from layer 0; all are alike)."""
    attn, mlp = model.layers[0].self_attn, model.layers[0].mlp
    hidden = model.spec.hidden_size
    modules = {
        "qkv_proj": ModuleShape(hidden, (attn.q_size, attn.kv_size, attn.kv_size)),
        "o_proj": ModuleShape(attn.q_size, (hidden,)),
        "gate_up_proj": ModuleShape(hidden, (mlp.intermediate, mlp.intermediate)),
        "down_proj": ModuleShape(mlp.intermediate, (hidden,)),
    }
    return LoRATargets(model_name, len(model.layers), modules)


def wrap_model(model: nn.Module, targets: LoRATargets, num_slots: int, max_rank: int,
               step: LoRAStep) -> list[dict[str, LoRALinear]]:
    """Replace each layer's qkv_proj, o_proj, gate_up_proj and down_proj by a `LoRALinear` around it; returns the
    wrappers per layer."""
    wrapped = []
    dtype, device = model.dtype, model.device
    for i, layer in enumerate(model.layers):
        owners = {"qkv_proj": layer.self_attn, "o_proj": layer.self_attn,
                  "gate_up_proj": layer.mlp, "down_proj": layer.mlp}
        per_layer = {}
        for name in FUSED_SLICES:
            owner = owners[name]
            module = LoRALinear(getattr(owner, name), i, targets.modules[name], num_slots, max_rank, dtype, device,
                                step)
            setattr(owner, name, module)
            per_layer[name] = module
        wrapped.append(per_layer)
    return wrapped
