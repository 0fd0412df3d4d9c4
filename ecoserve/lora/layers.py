"""Batched heterogeneous LoRA: each wrapped linear adds its rows' `x @ A_slot^T @ B_slot^T` per adapter slot.

Adapters live in a fixed pool of `max_loras` slots per wrapped module, each padded to `max_lora_rank`, so
shapes never change while adapters come and go. A step's tokens are grouped by slot into segments
(Punica's SGMV idea, on CPU). On a CPU where torch's cpublas micro-kernels run the model's dtype (float32
on AVX2 and up; bfloat16 with AMX) every module makes one native call for all its segments
(`kernels/lora_sgmv.cpp`: a shrink and an expand micro-kernel call per block of rows, 1-6 us each where a
oneDNN GEMM costs 20-60), its slots packed the way those kernels read them. Elsewhere (a GPU, no compiler,
no such instructions) the slots hold A [slots, n_slices * max_rank, in] and B^T block-diagonal over the
slices [slots, n_slices * max_rank, out], and each module takes one of two torch paths:

- per slot: a shrink and an expand GEMM over the slot's rows, using only the slot's own rank; a slot whose
  rows are one contiguous run is read and updated in place through views, otherwise its rows are gathered
  and scattered back with `index_add_`;
- stacked (several slots, while the stacked width stays within in + out): all rows through every active
  slot's A at once, each row's other slots masked off, then one GEMM with the slots' B stacked. On CPU a
  small GEMM costs ~35 us of fixed overhead however thin it is, so five calls beat a pair per slot.

Rows of the base model pay nothing, and a step without adapters costs one attribute test per module.
The model's modules are wrapped after loading (`wrap_model`); the wrapped base may be an `nn.Linear`, a
prepacked oneDNN linear or a quantized one: it is only called.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch
from torch import nn

from ecoserve.kernels import lora_sgmv, paths
from ecoserve.lora.checkpoint import FUSED_SLICES, LoRATargets, ModuleShape


def native_sgmv(dtype: torch.dtype, device: torch.device):
    """The native all-segments kernel where torch's cpublas micro-kernels run `dtype` on this CPU, else None."""
    return lora_sgmv() if device.type == "cpu" and paths.native_lora(dtype) else None


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
    versions: list[int] = field(default_factory=list)  # per slot: bumped whenever another adapter is put in it
    failed: list[BaseException | None] = field(default_factory=list)  # per slot: the load's error
    layer_events: list[list] = field(default_factory=list)  # per slot, per layer: a CUDA event (GPU loads)
    changed: threading.Condition = field(default_factory=threading.Condition)
    num_rows: int = 0  # tokens in the step
    max_rank: int = 0  # the highest rank among the step's slots
    _masks: dict[int, torch.Tensor] = field(default_factory=dict)  # width per slot -> [rows, slots * width]
    _native_args: dict[tuple[int, int], tuple] = field(default_factory=dict)  # (slices, v) -> the kernel's indices

    def __post_init__(self) -> None:
        self.ready = [0] * self.num_slots
        self.versions = [0] * self.num_slots
        self.failed = [None] * self.num_slots
        self.layer_events = [[] for _ in range(self.num_slots)]

    def set_segments(self, segments: list[Segment], num_rows: int) -> None:
        self.segments, self.num_rows = segments, num_rows
        self.max_rank = max((seg.rank for seg in segments), default=0)
        self._masks = {}
        self._native_args = {}

    def native_args(self, num_slices: int, v: int, segments: list[Segment] | None = None) -> tuple:
        """(rows, bounds, slots, widths) for `lora_sgmv_`: the segments' rows one after another, their offsets,
        slots and widths (slices x rank rounded up to v); for the step's segments, built once per step."""
        key = (num_slices, v)
        args = self._native_args.get(key) if segments is None else None
        if args is None:
            chosen = self.segments if segments is None else segments
            rows = [torch.arange(seg.rows.start, seg.rows.stop) if isinstance(seg.rows, slice) else seg.rows.cpu()
                    for seg in chosen]
            bounds = [0]
            for r in rows:
                bounds.append(bounds[-1] + len(r))
            args = (torch.cat(rows), torch.tensor(bounds), torch.tensor([seg.slot for seg in chosen]),
                    torch.tensor([-(-num_slices * seg.rank // v) * v for seg in chosen]))
            if segments is None:
                self._native_args[key] = args
        return args

    def mask(self, width: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """[rows, segments * width]: 1 where a row belongs to the segment whose `width` columns these are (the
        stacked path computes every slot's shrink for every row and keeps each row's own)."""
        mask = self._masks.get(width)
        if mask is None:
            mask = torch.zeros(self.num_rows, len(self.segments) * width, dtype=dtype, device=device)
            for j, seg in enumerate(self.segments):
                mask[seg.rows, j * width:(j + 1) * width] = 1
            self._masks[width] = mask
        return mask

    def wait(self, slot: int, layer: int) -> bool:
        """Block until layer `layer` of `slot` is resident (the loader runs ahead on its own thread); False if
        its load failed (the slot's rows then run without LoRA and the engine fails their requests)."""
        if self.ready[slot] <= layer:
            with self.changed:
                while self.ready[slot] <= layer and self.failed[slot] is None:
                    self.changed.wait()
            if self.ready[slot] <= layer:
                return False
        events = self.layer_events[slot]
        if events:  # a GPU: the compute stream waits for the copy stream's event of this layer only
            torch.cuda.current_stream().wait_event(events[layer])
        return True


class LoRALinear(nn.Module):
    """A base linear plus the LoRA of whichever slot each row's request uses.

    Per slot, A holds the adapter's slices' rows one after another (n_slices * r rows, r its own rank) and B^T
    is block-diagonal over them ([n_slices * r, out]: slice i's rows feed only slice i's columns), so a
    segment costs two GEMMs whatever the number of slices: on CPU the calls, not the zeros, are the cost.
    """

    def __init__(self, base: nn.Module, layer: int, shape: ModuleShape, num_slots: int, max_rank: int,
                 dtype: torch.dtype, device: torch.device, step: LoRAStep) -> None:
        super().__init__()
        self.base, self.layer, self.step = base, layer, step
        n = len(shape.slice_sizes)
        self.slice_sizes = shape.slice_sizes
        self.offsets = [sum(shape.slice_sizes[:i]) for i in range(n)]
        self.out_features = sum(shape.slice_sizes)
        v = 2 if dtype == torch.bfloat16 else 1  # the micro-kernels read bf16 B in pairs along the reduced dimension
        self.sgmv = native_sgmv(dtype, device) if shape.in_features % v == 0 else None
        if self.sgmv is not None:  # packed as the kernel reads them: A^T [in / v, k, v], B^T [W / v, out, v]
            self.v, self.width = v, -(-n * max_rank // v) * v
            a_shape = (shape.in_features // v, self.width, v)
            b_shape = (self.width // v, self.out_features, v)
        else:
            a_shape, b_shape = (n * max_rank, shape.in_features), (n * max_rank, self.out_features)
        self.register_buffer("lora_a", torch.zeros(num_slots, *a_shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("lora_bt", torch.zeros(num_slots, *b_shape, dtype=dtype, device=device), persistent=False)
        self.adapted = [False] * num_slots  # the slot's adapter adapts this module (else it is skipped)
        self.stack_limit = shape.in_features + self.out_features
        self._stack_key: tuple | None = None  # what `_stack` (A and B of the last stacked slots) was built for
        self._stack: tuple[torch.Tensor, torch.Tensor] | None = None

    def load_slot(self, slot: int, weights: tuple[torch.Tensor, list[torch.Tensor | None]] | None, rank: int,
                  non_blocking: bool = False) -> None:
        """Copy one adapter's weights of this module into `slot` (None: the adapter does not adapt it)."""
        if self.sgmv is not None:
            return self._load_packed(slot, weights, rank)
        self.lora_a[slot].zero_()  # the stacked path reads whole slots: nothing of an earlier adapter may stay
        self.lora_bt[slot].zero_()
        if weights is None:
            self.adapted[slot] = False
            return
        a, bts = weights
        rows = len(bts) * rank
        self.lora_a[slot, :rows].copy_(a, non_blocking=non_blocking)
        b = self.lora_bt[slot, :rows]
        for i, bt in enumerate(bts):
            if bt is not None:
                o = self.offsets[i]
                b[i * rank:(i + 1) * rank, o:o + self.slice_sizes[i]].copy_(bt, non_blocking=non_blocking)
        self.adapted[slot] = True

    def _load_packed(self, slot: int, weights: tuple[torch.Tensor, list[torch.Tensor | None]] | None,
                     rank: int) -> None:
        """`load_slot` for the native kernel. A^T is packed at the front of the slot at the adapter's own width k
        (its slices x rank, rounded up to v: [in / v, k, v], read without stride); B^T block-diagonal over the
        slices, whose first k rows are what a segment reads."""
        width, v, in_features = self.width, self.v, self.lora_a.shape[1] * self.v
        a_slot = self.lora_a[slot].view(-1)
        a_slot.zero_()
        b_full = torch.zeros(width, self.out_features, dtype=self.lora_bt.dtype)
        self.adapted[slot] = weights is not None
        if weights is not None:
            a, bts = weights
            k = -(-len(bts) * rank // v) * v
            a_full = torch.zeros(k, in_features, dtype=self.lora_a.dtype)
            a_full[:len(bts) * rank].copy_(a)
            a_slot[:in_features * k].view(in_features // v, k, v).copy_(a_full.view(k, -1, v).permute(1, 0, 2))
            for i, bt in enumerate(bts):
                if bt is not None:
                    o = self.offsets[i]
                    b_full[i * rank:(i + 1) * rank, o:o + self.slice_sizes[i]].copy_(bt)
        self.lora_bt[slot].copy_(b_full.view(width // v, v, -1).permute(0, 2, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        step = self.step
        segments = step.segments
        if not segments:
            return y
        layer, ready, n = self.layer, step.ready, len(self.slice_sizes)
        if self.sgmv is not None:
            return self._native(x, y, segments, n)
        if len(segments) > 1 and len(segments) * n * step.max_rank <= self.stack_limit:
            return self._stacked(x, y, segments, n * step.max_rank)
        for seg in segments:
            slot = seg.slot
            if (ready[slot] <= layer or step.layer_events[slot]) and not step.wait(slot, layer):
                continue
            if not self.adapted[slot]:
                continue
            k = n * seg.rank
            rows = seg.rows
            if isinstance(rows, slice):  # one contiguous run: updated in place
                y[rows].addmm_(torch.mm(x[rows], self.lora_a[slot, :k].t()), self.lora_bt[slot, :k])
            else:
                h = torch.mm(x.index_select(0, rows), self.lora_a[slot, :k].t())
                y.index_add_(0, rows, torch.mm(h, self.lora_bt[slot, :k]))
        return y

    def _native(self, x: torch.Tensor, y: torch.Tensor, segments: list[Segment], n: int) -> torch.Tensor:
        """Every segment in one native call; segments whose load failed, or whose adapter leaves this module
        alone, are left out (their rows get no LoRA here)."""
        step, layer = self.step, self.layer
        kept = [seg for seg in segments
                if (step.ready[seg.slot] > layer or step.wait(seg.slot, layer)) and self.adapted[seg.slot]]
        if not kept:
            return y
        args = step.native_args(n, self.v, None if len(kept) == len(segments) else kept)
        y = y.contiguous()
        self.sgmv(y, x.contiguous(), self.lora_a, self.lora_bt, *args)
        return y

    def _stacked(self, x: torch.Tensor, y: torch.Tensor, segments: list[Segment], width: int) -> torch.Tensor:
        """Several slots in few calls: every row through all the step's slots' A (stacked), the other slots'
        columns masked off, then one GEMM with their B stacked. Taken while the stacked width stays within
        the module's own (in + out): the wasted FLOPs then cost less than a GEMM pair per slot. The stacked
        copies are kept while the step's slots, their adapters and the width stay the same (most steps)."""
        step = self.step
        broken = False
        for seg in segments:
            slot = seg.slot
            if (step.ready[slot] <= self.layer or step.layer_events[slot]) and not step.wait(slot, self.layer):
                self.lora_a[slot].zero_()  # a failed load: its rows get no LoRA (their requests fail)
                self.lora_bt[slot].zero_()
                broken = True
        slots = tuple(seg.slot for seg in segments)
        key = (slots, width, tuple(step.versions[slot] for slot in slots))
        if broken or key != self._stack_key:
            if slots == tuple(range(slots[0], slots[0] + len(slots))):
                a = self.lora_a[slots[0]:slots[-1] + 1, :width]
                b = self.lora_bt[slots[0]:slots[-1] + 1, :width]
            else:
                index = torch.tensor(slots, device=x.device)
                a = self.lora_a[:, :width].index_select(0, index)
                b = self.lora_bt[:, :width].index_select(0, index)
            self._stack = (a.reshape(-1, a.shape[2]), b.reshape(-1, b.shape[2]))  # a view when already contiguous
            self._stack_key = None if broken else key
        a, b = self._stack
        h = torch.mm(x, a.t()).mul_(step.mask(width, x.dtype, x.device))
        return y.addmm_(h, b)

    def extra_repr(self) -> str:
        return f"layer={self.layer}, slots={self.lora_a.shape[0]}, slices={self.slice_sizes}"


def model_targets(model: nn.Module, model_name: str) -> LoRATargets:
    """The wrappable modules of a built Llama-family model and their shapes (from layer 0; all are alike).

    A mixture-of-experts model adapts only its attention projections: its MLPs are routed experts (and dense
    MLPs only in some layers), which an adapter of the attention-projection kind does not reach."""
    attn = model.layers[0].self_attn
    hidden = model.spec.hidden_size
    modules = {
        "qkv_proj": ModuleShape(hidden, (attn.q_size, attn.kv_size, attn.kv_size)),
        "o_proj": ModuleShape(attn.q_size, (hidden,)),
    }
    if all(hasattr(layer.mlp, "gate_up_proj") for layer in model.layers):
        inter = model.layers[0].mlp.intermediate
        modules["gate_up_proj"] = ModuleShape(hidden, (inter, inter))
        modules["down_proj"] = ModuleShape(inter, (hidden,))
    return LoRATargets(model_name, len(model.layers), modules)


def wrap_model(model: nn.Module, targets: LoRATargets, num_slots: int, max_rank: int,
               step: LoRAStep) -> list[dict[str, LoRALinear]]:
    """Replace each layer's target modules (qkv_proj, o_proj and, in a dense model, gate_up_proj and down_proj)
    by a `LoRALinear` around it; returns the wrappers per layer."""
    wrapped = []
    dtype, device = model.dtype, model.device
    for i, layer in enumerate(model.layers):
        owners = {"qkv_proj": layer.self_attn, "o_proj": layer.self_attn,
                  "gate_up_proj": layer.mlp, "down_proj": layer.mlp}
        per_layer = {}
        for name in targets.modules:
            owner = owners[name]
            module = LoRALinear(getattr(owner, name), i, targets.modules[name], num_slots, max_rank, dtype, device,
                                step)
            setattr(owner, name, module)
            per_layer[name] = module
        wrapped.append(per_layer)
    return wrapped
