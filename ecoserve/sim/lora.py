"""Multi-LoRA serving in the simulator: what an adapter costs and which adapters an instance holds
(`sim/lora_experiment.py` asks how many adapters a cluster serves within its SLOs).

Costs follow the adapters' shapes on the model: an adapter of rank r on the seven projections of every
layer holds r x (in + out) weights per projection; a token through it costs 2 r (in + out) FLOPs per
projection (x A, then B), so a step's LoRA compute is (sum over its tokens of their adapter's rank) times
that per-rank cost, and its memory traffic the weights of the distinct adapters it runs. An instance holds
up to `max_loras` adapters on the device (the batch's slots: the shared scheduler admits requests of at most
that many adapters at once, as the engine's does); one it lacks is copied in over the host link
(`load_bandwidth`) when a step first needs it, evicting the least recently used one that step does not
use. With `layerwise_loading` (AuLoRA) the copy runs layer by layer beside the step's compute, so the step
takes the longer of the two plus one layer's copy; without it the copy comes first.
"""
from __future__ import annotations

import dataclasses
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from ecoserve.request import LoRARequest
from ecoserve.sim.models import ModelSpec
from ecoserve.sim.workload import SimRequest


@dataclass(frozen=True)
class LoRASimConfig:
    """The adapters of a simulated workload and how instances hold and load them."""

    num_adapters: int = 1
    rank: int = 8
    max_loras: int = 4  # adapters an instance holds on the device at once
    load_bandwidth: float = 16e9  # bytes/s host -> device (PCIe 4.0 x16, effective)
    layerwise_loading: bool = True
    zipf_alpha: float = 0.0  # adapter popularity: 0 uniform, > 0 Zipf (adapter k drawn with weight k^-alpha)

    def __post_init__(self) -> None:
        if self.num_adapters < 1 or self.rank < 1 or self.max_loras < 1:
            raise ValueError(f"num_adapters, rank and max_loras must be >= 1, got {self}")
        if self.load_bandwidth <= 0 or self.zipf_alpha < 0:
            raise ValueError(f"load_bandwidth must be > 0 and zipf_alpha >= 0, got {self}")


def lora_params_per_rank(model: ModelSpec) -> int:
    """Adapter weights per unit of rank: sum of (in + out) over q, k, v, o, gate, up, down of every layer."""
    h, kv, inter = model.hidden_size, model.num_kv_heads * model.head_dim, model.intermediate_size
    per_layer = (h + h) + 2 * (h + kv) + (h + h) + 2 * (h + inter) + (inter + h)
    return model.num_layers * per_layer


def adapter_bytes(model: ModelSpec, rank: int) -> float:
    return rank * lora_params_per_rank(model) * model.dtype_bytes


def adapter_name(k: int) -> str:
    return f"lora-{k}"


def assign_adapters(requests: list[SimRequest], config: LoRASimConfig, seed: int = 0) -> list[SimRequest]:
    """Each request with an adapter drawn by `config`'s popularity (seeded)."""
    rng = np.random.default_rng(seed + 7919)
    weights = np.arange(1, config.num_adapters + 1, dtype=float) ** -config.zipf_alpha
    picks = rng.choice(config.num_adapters, size=len(requests), p=weights / weights.sum())
    return [dataclasses.replace(r, lora_name=adapter_name(int(k))) for r, k in zip(requests, picks)]


class AdapterCache:
    """The adapters one simulated instance holds on the device, least recently used first."""

    def __init__(self, model: ModelSpec, config: LoRASimConfig) -> None:
        self.config = config
        self.adapter_bytes = adapter_bytes(model, config.rank)
        self.num_layers = model.num_layers
        self.resident: OrderedDict[str, None] = OrderedDict()
        self.loads = 0
        self.evictions = 0
        self._requests: dict[str, LoRARequest] = {}

    def request_of(self, name: str) -> LoRARequest:
        """The adapter as requests carry it, so that the scheduler admits at most `max_loras` adapters per batch."""
        lora = self._requests.get(name)
        if lora is None:
            lora = self._requests[name] = LoRARequest(name, len(self._requests) + 1, f"sim://{name}")
        return lora

    def load_time(self, used: set[str]) -> float:
        """Make the step's adapters resident; the seconds their copies take (0 when all were there)."""
        missing = [name for name in used if name not in self.resident]
        for name in used:
            if name in self.resident:
                self.resident.move_to_end(name)
        for name in missing:
            while len(self.resident) >= self.config.max_loras:
                victim = next((n for n in self.resident if n not in used), None)
                if victim is None:  # the step runs more adapters than slots: they all stay for it
                    break
                del self.resident[victim]
                self.evictions += 1
            self.resident[name] = None
            self.loads += 1
        return len(missing) * self.adapter_bytes / self.config.load_bandwidth

    def step_time(self, compute_s: float, load_s: float) -> float:
        """A step's time with `load_s` of adapter copies: overlapped layer by layer, or before it."""
        if not load_s:
            return compute_s
        if self.config.layerwise_loading:
            return max(compute_s, load_s) + load_s / self.num_layers
        return compute_s + load_s
