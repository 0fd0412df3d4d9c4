"""PEFT LoRA checkpoints (`adapter_config.json` + `adapter_model.safetensors`) read into our module layout.

Opening a checkpoint reads only its config and the safetensors header, and checks everything that could be
wrong with it against the model (rank, targets, shapes, base model) so a bad adapter fails at once with a
clear message; the tensors are read one decoder layer at a time (`read_layer`), which is what lets the
layer-wise loader start a step before a cold adapter is fully read.

Our model fuses q/k/v into `qkv_proj` and gate/up into `gate_up_proj`; an adapter's q, k and v (any
subset) become slices of one fused LoRA: A stacks the slices' rows (one shrink GEMM) and B^T is one block per
slice, laid block-diagonally in the slot (one expand GEMM). The scaling (`lora_alpha / r`, or `lora_alpha / sqrt(r)` with rsLoRA) is
folded into B.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

# our fused module -> the HF projections it holds, in output order
FUSED_SLICES: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "o_proj": ("o_proj",),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "down_proj": ("down_proj",),
}
PROJECTION_TO_FUSED = {proj: (fused, i) for fused, projs in FUSED_SLICES.items() for i, proj in enumerate(projs)}
_KEY = re.compile(r"^(?:base_model\.model\.)?(?:model\.)?layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


class LoRAAdapterError(ValueError):
    """An adapter that cannot be served on this engine; the message says why. Nothing else is affected."""


@dataclass(frozen=True)
class ModuleShape:
    """One wrapped module of the model: its input width and the widths of its output slices."""

    in_features: int
    slice_sizes: tuple[int, ...]


@dataclass(frozen=True)
class LoRATargets:
    """What an adapter may target on this model: layers and wrapped modules with their shapes."""

    model_name: str
    num_layers: int
    modules: dict[str, ModuleShape]

    def projections(self) -> list[str]:
        """The HF projections an adapter may target on this model."""
        return [p for p, (fused, _) in PROJECTION_TO_FUSED.items() if fused in self.modules]

    def projection_shape(self, projection: str) -> tuple[int, int]:
        """(in, out) of one HF projection."""
        fused, i = PROJECTION_TO_FUSED[projection]
        shape = self.modules[fused]
        return shape.in_features, shape.slice_sizes[i]


# One layer of an adapter in our layout: fused module -> (A [n_slices * r, in], per-slice B^T [r, out] * scale,
# None where the adapter does not target the slice).
LayerWeights = dict[str, tuple[torch.Tensor, list[torch.Tensor | None]]]


class AdapterCheckpoint:
    """A validated PEFT checkpoint: rank, scale and targets known, tensors read on demand, layer by layer."""

    def __init__(self, path: str | Path, targets: LoRATargets, max_lora_rank: int,
                 base_model_name: str | None = None) -> None:
        self.path = Path(path)
        config = self._read_config()
        self.rank = self._check_rank(config, max_lora_rank)
        alpha = config.get("lora_alpha", self.rank)
        self.scale = alpha / math.sqrt(self.rank) if config.get("use_rslora") else alpha / self.rank
        self._check_features(config, targets)
        self._check_base(base_model_name, targets)
        self.targets = targets
        self._tensors = self._index_tensors(targets)
        self.layers = sorted({layer for layer, _ in self._tensors})
        self.projections = sorted({proj for _, proj in self._tensors})

    def _fail(self, why: str) -> LoRAAdapterError:
        return LoRAAdapterError(f"LoRA adapter at {self.path}: {why}")

    def _read_config(self) -> dict:
        config_path = self.path / CONFIG_FILE
        if not self.path.is_dir():
            raise self._fail("no such directory (a PEFT adapter is a directory with adapter_config.json and "
                             "adapter_model.safetensors)")
        if not config_path.is_file():
            raise self._fail(f"{CONFIG_FILE} is missing")
        if not (self.path / WEIGHTS_FILE).is_file():
            raise self._fail(f"{WEIGHTS_FILE} is missing (only safetensors checkpoints are read)")
        try:
            config = json.loads(config_path.read_text())
        except (OSError, ValueError) as e:
            raise self._fail(f"{CONFIG_FILE} is not valid JSON: {e}") from None
        if not isinstance(config, dict):
            raise self._fail(f"{CONFIG_FILE} must hold a JSON object")
        kind = config.get("peft_type", "LORA")
        if str(kind).upper() != "LORA":
            raise self._fail(f"peft_type is {kind!r}; only LORA adapters are served")
        return config

    def _check_rank(self, config: dict, max_lora_rank: int) -> int:
        rank = config.get("r")
        if not isinstance(rank, int) or rank < 1:
            raise self._fail(f"'r' in {CONFIG_FILE} must be a positive integer, got {rank!r}")
        if rank > max_lora_rank:
            raise self._fail(f"rank {rank} is above --max-lora-rank {max_lora_rank}; restart with "
                             f"--max-lora-rank {rank} or more to serve it")
        return rank

    def _check_features(self, config: dict, targets: LoRATargets) -> None:
        unsupported = []
        if config.get("use_dora"):
            unsupported.append("DoRA (use_dora)")
        if config.get("bias", "none") != "none":
            unsupported.append(f"trained biases (bias={config['bias']!r})")
        if config.get("modules_to_save"):
            unsupported.append(f"fully trained modules (modules_to_save={config['modules_to_save']})")
        if config.get("rank_pattern") or config.get("alpha_pattern"):
            unsupported.append("per-module ranks or alphas (rank_pattern / alpha_pattern)")
        if config.get("fan_in_fan_out"):
            unsupported.append("fan_in_fan_out (Conv1D-style) weights")
        if unsupported:
            raise self._fail(f"uses {', '.join(unsupported)}, which this engine does not serve")
        wanted = config.get("target_modules")
        if isinstance(wanted, list):
            adapted = targets.projections()
            lacking = sorted(set(wanted) - set(adapted))
            if lacking:
                raise self._fail(f"targets modules this model lacks or does not adapt: {lacking} (LoRA applies to "
                                 f"{', '.join(adapted)})")

    def _check_base(self, base_model_name: str | None, targets: LoRATargets) -> None:
        if base_model_name is None:
            return
        served = targets.model_name
        if base_model_name not in (served, Path(served).name, str(Path(served).resolve())):
            raise self._fail(f"its base model is {base_model_name!r}, but this engine serves {served!r}")

    def _index_tensors(self, targets: LoRATargets) -> dict[tuple[int, str], dict[str, str]]:
        """(layer, projection) -> {"A": tensor name, "B": tensor name}, with every shape checked."""
        from safetensors import safe_open

        try:
            with safe_open(self.path / WEIGHTS_FILE, framework="pt") as f:
                shapes = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
        except Exception as e:  # safetensors raises its own error types for a damaged file
            raise self._fail(f"{WEIGHTS_FILE} cannot be read: {e}") from None
        index: dict[tuple[int, str], dict[str, str]] = {}
        for name, shape in shapes.items():
            m = _KEY.match(name)
            if m is None:
                raise self._fail(f"tensor {name!r} is not a LoRA A/B weight of a decoder layer's projection "
                                 f"(this model adapts {', '.join(PROJECTION_TO_FUSED)})")
            layer, proj, kind = int(m.group(1)), m.group(2), m.group(3)
            if proj not in PROJECTION_TO_FUSED or PROJECTION_TO_FUSED[proj][0] not in targets.modules:
                raise self._fail(f"targets module {proj!r}, which this model lacks or does not adapt (LoRA applies "
                                 f"to {', '.join(targets.projections())})")
            if layer >= targets.num_layers:
                raise self._fail(f"has layer {layer}, the base model only {targets.num_layers} layers: it was "
                                 f"trained for another base model")
            fan_in, fan_out = targets.projection_shape(proj)
            want = (self.rank, fan_in) if kind == "A" else (fan_out, self.rank)
            if shape != want:
                raise self._fail(f"tensor {name!r} has shape {shape}, this base model needs {want} (rank "
                                 f"{self.rank}): it was trained for another base model")
            index.setdefault((layer, proj), {})[kind] = name
        for (layer, proj), pair in index.items():
            if len(pair) != 2:
                raise self._fail(f"layer {layer} {proj} has no lora_{'B' if 'A' in pair else 'A'} weight")
        if not index:
            raise self._fail(f"{WEIGHTS_FILE} holds no LoRA weights")
        return index

    def read_layer(self, layer: int, dtype: torch.dtype) -> LayerWeights:
        """One decoder layer's weights in our layout (empty if the adapter skips the layer)."""
        from safetensors import safe_open

        out: LayerWeights = {}
        r = self.rank
        with safe_open(self.path / WEIGHTS_FILE, framework="pt") as f:
            for fused, projs in FUSED_SLICES.items():
                present = [(i, self._tensors.get((layer, p))) for i, p in enumerate(projs)]
                if not any(names for _, names in present):
                    continue
                shape = self.targets.modules[fused]
                a = torch.zeros(len(projs) * r, shape.in_features, dtype=dtype)
                bs: list[torch.Tensor | None] = []
                for i, names in present:
                    if names is None:
                        bs.append(None)
                        continue
                    a[i * r:(i + 1) * r] = f.get_tensor(names["A"])
                    bs.append((f.get_tensor(names["B"]).float() * self.scale).t().contiguous().to(dtype))
                out[fused] = (a, bs)
        return out
