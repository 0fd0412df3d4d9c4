"""What a mixture of experts adds to the roofline of a step: expert GEMMs by tokens per expert, the
expert-parallel all-to-all, and expert offload to host memory under the placement policy.

- Compute and weight reads follow the experts a batch touches (`ModelSpec.experts_touched`, balanced
  routing), each expert's rows rounded up to the GEMM tile: a decode batch reads few experts, a large
  prefill all of them.
- Expert parallel (`expert_parallel`): the ranks of the instance hold whole experts; each MoE layer
  sends every token's hidden state to the ranks of its experts and back (two all-to-alls over `ep_link`)
  where tensor parallelism all-reduces the MLP output; the attention all-reduce stays.
- Offload (`resident_experts` < experts): each layer keeps that many experts on the GPUs, the rest in
  host memory. Per step, a router draw with Zipf-skewed popularity (`expert_skew`) goes through
  `ecoserve.moe.PlacementPolicy` with the resident set it targets (the most popular experts): hits run
  on the GPU, misses are loaded over PCIe or computed on the host (`placement`: the policy's rule, or
  all loaded, or all on the host, for comparison). The step pays each layer's time beyond running every
  routed expert on the GPU, averaged over draws and read by tokens between powers of two. The prefetch
  that restores the resident set after an eviction is taken to hide in idle link time.
"""
from __future__ import annotations

import bisect
import random
from dataclasses import dataclass, field
from functools import lru_cache

from ecoserve.moe import CostTable, ExpertPopularity, PlacementPolicy, RooflineCost
from ecoserve.sim.hardware import CPU, GPU, Link
from ecoserve.sim.models import ModelSpec

PLACEMENTS = ("aptmoe", "load", "host")
_GRID = tuple(2 ** i for i in range(14))  # 1 .. 8192 tokens per step
_DRAWS = 3


@dataclass
class MoEPerf:
    model: ModelSpec
    gpu: GPU
    tp: int
    flops: float  # achieved FLOP/s of the instance (all its GPUs)
    bandwidth: float  # achieved bytes/s of the instance's GPU memory
    tile: callable  # the roofline's row rounding: tokens -> tiled tokens
    expert_parallel: bool = False
    ep_link: Link | None = None
    resident_experts: int | None = None  # per layer and instance; None: every expert on the GPUs
    host: CPU | None = None
    pcie: Link | None = None  # one GPU's host link; the instance has tp of them
    expert_skew: float = 0.0
    placement: str = "aptmoe"
    _offload: tuple[float, ...] = field(default=(), init=False, repr=False)

    def __post_init__(self) -> None:
        m = self.model
        if self.placement not in PLACEMENTS:
            raise ValueError(f"placement must be one of {', '.join(PLACEMENTS)}, got {self.placement!r}")
        if self.expert_skew < 0:
            raise ValueError(f"expert skew must be >= 0, got {self.expert_skew}")
        if self.resident_experts is not None:
            if not 0 <= self.resident_experts <= m.num_experts:
                raise ValueError(f"resident experts per layer must be in [0, {m.num_experts}] for {m.name}, "
                                 f"got {self.resident_experts}")
            if self.host is None or self.pcie is None:
                raise ValueError("expert offload needs the host CPU and the GPU's host link")
            if self.resident_experts < m.num_experts:
                self._offload = _offload_table(m, self.flops, self.bandwidth, self.host, self.pcie, self.tp,
                                               self.resident_experts, self.expert_skew, self.placement)

    def expert_flops(self, num_tokens: int) -> float:
        """The routed experts' matmul FLOPs of a step, every touched expert's rows tiled."""
        m = self.model
        touched = m.experts_touched(num_tokens)
        per_expert = num_tokens * m.num_experts_per_tok / touched
        return m.num_layers * touched * self.tile(max(round(per_expert), 1)) * 2.0 * m.expert_params

    def expert_read_bytes(self, num_tokens: int) -> float:
        return self.model.num_layers * self.model.experts_touched(num_tokens) * self.model.expert_bytes

    def all_to_all_s(self, num_tokens: int) -> float:
        """Dispatch and combine of one step over `ep_link`, all MoE layers."""
        ep, m, lk = self.tp, self.model, self.ep_link
        if not self.expert_parallel or ep <= 1:
            return 0.0
        remote = num_tokens / ep * m.num_experts_per_tok * (ep - 1) / ep * m.hidden_size * m.dtype_bytes
        one = (ep - 1) * lk.latency + remote / (lk.bandwidth * lk.efficiency)
        return 2 * m.num_layers * one

    def offload_s(self, num_tokens: int) -> float:
        """Time the offloaded experts add to a step of `num_tokens` (0 with every expert resident)."""
        if not self._offload or num_tokens <= 0:
            return 0.0
        i = bisect.bisect_left(_GRID, num_tokens)
        if i == 0:
            return self._offload[0]
        if i == len(_GRID):
            return self._offload[-1] * num_tokens / _GRID[-1]
        x0, x1 = _GRID[i - 1], _GRID[i]
        return self._offload[i - 1] + (self._offload[i] - self._offload[i - 1]) * (num_tokens - x0) / (x1 - x0)

    @property
    def offloaded_bytes(self) -> float:
        """Expert weights kept in host memory instead of on the GPUs."""
        if self.resident_experts is None:
            return 0.0
        m = self.model
        return m.num_layers * (m.num_experts - self.resident_experts) * m.expert_bytes


def zipf_popularity(num_experts: int, skew: float) -> list[float]:
    """Expert shares proportional to 1 / rank^skew (0: uniform)."""
    w = [1.0 / (e + 1) ** skew for e in range(num_experts)]
    total = sum(w)
    return [x / total for x in w]


def placement_costs(model: ModelSpec, flops: float, bandwidth: float, host: CPU, pcie: Link, tp: int) -> CostTable:
    """The policy's cost table for one expert: on the instance's GPUs, on the host, and over tp PCIe links."""
    fpt, nbytes = 2.0 * model.expert_params, model.expert_bytes
    device = RooflineCost(fpt, nbytes, flops, bandwidth, launch_s=5e-6)
    on_host = RooflineCost(fpt, nbytes, host.flops * host.flops_efficiency,
                           host.mem_bandwidth * host.bandwidth_efficiency, launch_s=20e-6)
    return CostTable.from_link(on_host, device, nbytes, pcie.bandwidth * pcie.efficiency * tp, pcie.latency)


@lru_cache(maxsize=64)
def _offload_table(model: ModelSpec, flops: float, bandwidth: float, host: CPU, pcie: Link, tp: int,
                   resident: int, skew: float, placement: str) -> tuple[float, ...]:
    """Mean extra seconds per step at each `_GRID` token count, all layers (cached: instances share it)."""
    e, k = model.num_experts, model.num_experts_per_tok
    costs = placement_costs(model, flops, bandwidth, host, pcie, tp)
    popularity = ExpertPopularity(1, e)
    shares = zipf_popularity(e, skew)
    popularity.seed(0, shares)
    policy = PlacementPolicy(1, e, resident, costs, popularity)
    on_gpu = set(policy.resident_target(0))
    rng = random.Random(0)
    cum = [sum(shares[:i + 1]) for i in range(e)]
    act_bytes = model.hidden_size * model.dtype_bytes
    link_bw = pcie.bandwidth * pcie.efficiency * tp
    out = []
    for n in _GRID:
        extra = 0.0
        for _ in range(_DRAWS):
            counts = [0] * e
            for x in rng.choices(range(e), cum_weights=cum, k=n * k):
                counts[x] += 1
            plan = policy.plan_layer(0, counts, on_gpu)
            hits, misses = plan.hits, plan.load + plan.host
            load, host = {"aptmoe": (plan.load, plan.host), "load": (misses, ()), "host": ((), misses)}[placement]
            dev = costs.device_s
            t_device = max(sum(dev(counts[x]) for x in hits), len(load) * costs.load_s) + \
                sum(dev(counts[x]) for x in load)
            host_tokens = sum(counts[x] for x in host)
            t_host = sum(costs.host_s(counts[x]) for x in host) + (2 * host_tokens * act_bytes / link_bw if host else 0)
            extra += max(t_device, t_host) - sum(dev(c) for c in counts if c)
        out.append(max(extra / _DRAWS, 0.0) * model.num_layers)
    return tuple(out)
