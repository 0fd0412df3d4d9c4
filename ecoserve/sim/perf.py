"""Performance models: predicted duration of one forward step of an instance.

A step is described by `StepWork`, the aggregates of its batch. Two models:

- `RooflinePerf`: max-like combination of compute time (GEMM FLOPs with token counts rounded up to
  the GEMM tile, plus attention) and memory time (weights, KV reads and writes), plus
  tensor-parallel all-reduces over the intra-node link, pipeline sends and a fixed per-step
  overhead. Efficiencies are per-GPU knobs; L20's are calibrated on the TD-Pipe profile.
- `TablePerf`: a measured `tokens,ms` CSV read by `cluster.profile.StepTimeTable` (linear between
  rows, extrapolated past its end), plus an optional KV-read term that the tables (prefill-shaped)
  do not contain.
- `StepProfilePerf`: a measured `steps.csv` of `scripts/profile_steps.py` (prefill by prompt tokens,
  decode by sequences and context, hybrid by both), interpolated in each dimension: the step
  types' real costs, where a `tokens,ms` table has one curve for every shape.

Both add the step-type costs (`StepTypeCosts`), zero by default: a fixed overhead for a step that
carries prompt tokens, and an interference term per decode token in a hybrid batch. vLLM 0.7.3
(the paper's baselines) captures only pure-decode batches as CUDA graphs and runs prefill and
hybrid steps eagerly; docs/reproduction.md sweeps both parameters.
"""
from __future__ import annotations

import bisect
import csv
import math
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple, Protocol

from ecoserve.cluster.profile import StepTimeTable
from ecoserve.sim.hardware import GPU, Link, cpu as get_cpu, gpu as get_gpu, link as get_link
from ecoserve.sim.lora import lora_params_per_rank
from ecoserve.sim.models import ModelSpec, model as get_model
from ecoserve.sim.moe import MoEPerf
from ecoserve.sim.network import allreduce_time


class StepWork(NamedTuple):
    """Aggregates of a batch that the models need; built once per step (a NamedTuple: cheap to build)."""

    num_tokens: int
    num_seqs: int
    num_sampled: int
    attn_pairs: float  # sum over requests of causal (query, key) pairs
    kv_read_tokens: int  # context tokens whose KV is read
    num_prompt_tokens: int = 0  # of num_tokens, those of prompt chunks (the rest are decodes)
    lora_rank_tokens: int = 0  # sum over tokens of their LoRA adapter's rank (0: no adapters)
    lora_weight_bytes: float = 0.0  # the weights of the distinct adapters the step runs


@dataclass(frozen=True)
class StepTypeCosts:
    """Costs by step type on top of the model's time (seconds); zero reproduces the plain model.

    `prompt_step_overhead_s`: added to every step that carries prompt tokens (prefill or hybrid),
    e.g. eager execution where pure decodes replay a CUDA graph. `hybrid_decode_token_s`: added
    per decode token of a step that also carries prompt tokens (interference in hybrid batches).
    """

    prompt_step_overhead_s: float = 0.0
    hybrid_decode_token_s: float = 0.0

    def __post_init__(self) -> None:
        if self.prompt_step_overhead_s < 0 or self.hybrid_decode_token_s < 0:
            raise ValueError(f"step-type costs must be >= 0, got {self}")

    def extra(self, w: StepWork) -> float:
        if not w.num_prompt_tokens:
            return 0.0
        return self.prompt_step_overhead_s + self.hybrid_decode_token_s * (w.num_tokens - w.num_prompt_tokens)


class PerfModel(Protocol):
    def work_time(self, work: StepWork) -> float: ...

    def predicted_prefill_time(self, num_tokens: int) -> float: ...


class _Base:
    def predicted_prefill_time(self, num_tokens: int) -> float:
        """One request's whole prompt in one step (Algorithm 1's offline profile by length)."""
        n = max(int(num_tokens), 1)
        return self.work_time(StepWork(n, 1, 1, n * (n + 1) / 2, n, n))


@dataclass
class RooflinePerf(_Base):
    model: ModelSpec
    gpu: GPU
    tp: int = 1
    pp: int = 1
    link: Link | None = None  # TP all-reduce link; None: the GPU's intra-node link
    pp_link: Link | None = None
    flops_efficiency: float | None = None  # None: the GPU's default
    bandwidth_efficiency: float | None = None
    overhead_s: float = 3.0e-3
    overlap_p: float = 3.0  # compute/memory overlap: p-norm exponent (inf = perfect overlap)
    token_tile: int = 128  # GEMM row tile; token counts round up to it ...
    small_tile: int = 16  # ... except skinny batches (<= small_tile tokens), which run as GEMV-like kernels
    tp_efficiency: float = 1.0  # extra knob for TP scaling losses beyond the all-reduce
    # Fixed cost of one TP all-reduce call (NCCL over PCIe measures 20-60 us at TP=4); None: the
    # link's ring model, 2(tp-1) hops of its latency (12 us at TP=4 on `pcie4`).
    allreduce_latency_s: float | None = None
    step_costs: StepTypeCosts = StepTypeCosts()
    # mixture of experts (sim/moe.py): experts split over the TP ranks, all-to-all over `ep_link` (None: `link`);
    # `moe_resident_experts` per layer on the GPUs, the rest in `host` memory behind `host_link`
    expert_parallel: bool = False
    ep_link: Link | None = None
    moe_resident_experts: int | None = None
    host: str = "xeon-6348"
    host_link: Link | None = None  # None: the GPU's intra-node link (PCIe)
    expert_skew: float = 0.0
    expert_placement: str = "aptmoe"

    def __post_init__(self) -> None:
        if self.tp < 1 or self.pp < 1:
            raise ValueError(f"tp and pp must be >= 1, got tp={self.tp} pp={self.pp}")
        if self.allreduce_latency_s is not None and self.allreduce_latency_s < 0:
            raise ValueError(f"allreduce_latency_s must be >= 0, got {self.allreduce_latency_s}")
        if self.link is None:
            self.link = get_link(self.gpu.intra_node_link)
        if self.pp_link is None:
            self.pp_link = self.link
        f_eff = self.flops_efficiency or self.gpu.flops_efficiency
        b_eff = self.bandwidth_efficiency or self.gpu.bandwidth_efficiency
        n = self.tp * self.pp
        self._flops = self.gpu.bf16_flops * f_eff * self.tp * self.tp_efficiency  # one stage at a time
        self._bw = self.gpu.mem_bandwidth * b_eff * self.tp
        self._weight_s = self.model.streamed_weight_bytes / self._bw
        self._kv_bytes = self.model.kv_bytes_per_token
        self._attn_flops_per_pair = 4.0 * self.model.num_layers * self.model.num_heads * self.model.head_dim
        self._act_bytes_per_token = self.model.hidden_size * self.model.dtype_bytes
        self._per_gpu_weights = self.model.weight_bytes / n
        self._linear_flops_per_token = self.model.linear_flops_per_token  # properties: read once, not per step
        self._lm_head_flops = self.model.lm_head_flops
        self._lora_flops_per_rank_token = 2.0 * lora_params_per_rank(self.model)
        self._moe = self._moe_perf() if self.model.is_moe else None
        if self._moe is not None:  # the experts' share comes per step, by the experts the batch touches
            m = self.model
            self._linear_flops_per_token = 2.0 * m.num_layers * m.dense_params_per_layer
            self._weight_s = (m.streamed_weight_bytes - m.num_layers * m.num_experts * m.expert_bytes) / self._bw
        elif self.expert_parallel or self.moe_resident_experts is not None:
            raise ValueError(f"{self.model.name} is not a mixture of experts: no expert parallel or offload")

    def _moe_perf(self) -> MoEPerf:
        link = lambda x, default: get_link(x) if isinstance(x, str) else (x or default)
        self.ep_link = link(self.ep_link, self.link)
        self.host_link = link(self.host_link, get_link(self.gpu.intra_node_link))
        return MoEPerf(self.model, self.gpu, self.tp, self._flops, self._bw, self.tiled_tokens,
                       expert_parallel=self.expert_parallel, ep_link=self.ep_link,
                       resident_experts=self.moe_resident_experts, host=get_cpu(self.host), pcie=self.host_link,
                       expert_skew=self.expert_skew, placement=self.expert_placement)

    def tiled_tokens(self, n: int) -> int:
        if n <= self.small_tile:
            return self.small_tile
        return -(-n // self.token_tile) * self.token_tile

    def work_time(self, w: StepWork) -> float:
        if w.num_tokens <= 0:
            return 0.0
        m = self.model
        flops = (self._linear_flops_per_token * self.tiled_tokens(w.num_tokens) + self._lm_head_flops * w.num_sampled
                 + self._attn_flops_per_pair * w.attn_pairs)
        t_memory = self._weight_s + (w.kv_read_tokens + w.num_tokens) * self._kv_bytes / self._bw
        if w.lora_rank_tokens:  # x A_i B_i of each token through its adapter, and the adapters' weights
            flops += self._lora_flops_per_rank_token * w.lora_rank_tokens
            t_memory += w.lora_weight_bytes / self._bw
        t_compute = flops / self._flops
        moe = self._moe
        if moe is not None:
            t_compute += moe.expert_flops(w.num_tokens) / self._flops
            t_memory += moe.expert_read_bytes(w.num_tokens) / self._bw
        p = self.overlap_p
        t = (t_compute ** p + t_memory ** p) ** (1.0 / p) if math.isfinite(p) else max(t_compute, t_memory)
        if self.tp > 1:  # two all-reduces per layer of the step's activations (one with expert parallel)
            per_call = allreduce_time(w.num_tokens * self._act_bytes_per_token, self.tp, self.link)
            if self.allreduce_latency_s is not None:
                per_call += self.allreduce_latency_s - 2 * (self.tp - 1) * self.link.latency
            t += (1 if self.expert_parallel else 2) * m.num_layers * per_call
        if moe is not None:
            t += moe.all_to_all_s(w.num_tokens) + moe.offload_s(w.num_tokens)
        if self.pp > 1:
            lk = self.pp_link
            t += (self.pp - 1) * (lk.latency + w.num_tokens * self._act_bytes_per_token / (lk.bandwidth * lk.efficiency))
        t += self.overhead_s
        return t + self.step_costs.extra(w) if w.num_prompt_tokens else t

    @property
    def kv_capacity_tokens(self) -> int:
        """KV tokens that fit: 90% of the instance's memory minus the weights."""
        free = 0.9 * self.gpu.memory_bytes * self.tp * self.pp - self.model.weight_bytes
        if self._moe is not None:  # offloaded experts live in host memory
            free += self._moe.offloaded_bytes
        return max(int(free / self.model.kv_bytes_per_token), 0)


@dataclass
class TablePerf(_Base):
    """A measured `tokens -> ms` profile (TD-Pipe's `Total Length,Execute Time` CSV)."""

    table: StepTimeTable
    kv_bytes_per_token: float = 0.0  # > 0 adds KV reads at `kv_bandwidth` (tables do not include them)
    kv_bandwidth: float = 1.0
    scale: float = 1.0  # e.g. 1/pp for TD-Pipe's single-GPU-equivalent tables
    step_costs: StepTypeCosts = StepTypeCosts()

    @classmethod
    def from_csv(cls, path: str | Path, **kw) -> "TablePerf":
        return cls(StepTimeTable.from_csv(path), **kw)

    def work_time(self, w: StepWork) -> float:
        if w.num_tokens <= 0:
            return 0.0
        t = self.table.ms(w.num_tokens) * 1e-3 * self.scale
        if self.kv_bytes_per_token:
            t += w.kv_read_tokens * self.kv_bytes_per_token / self.kv_bandwidth
        return t + self.step_costs.extra(w) if w.num_prompt_tokens else t


def _interp(xs: list[float], ys: list[float], x: float, extrapolate: bool = True) -> float:
    """Linear between points; the first value below them (and everywhere for a single point); past
    the last, along the last segment (never falling) when `extrapolate`, else the last value."""
    if x <= xs[0] or len(xs) == 1:
        return ys[0]
    i = bisect.bisect_left(xs, x)
    if i >= len(xs):
        if not extrapolate:
            return ys[-1]
        slope = max((ys[-1] - ys[-2]) / (xs[-1] - xs[-2]), 0.0)
        return ys[-1] + slope * (x - xs[-1])
    x0, x1 = xs[i - 1], xs[i]
    return ys[i - 1] + (ys[i] - ys[i - 1]) * (x - x0) / (x1 - x0)


@dataclass(frozen=True)
class _Grid:
    """Values on the full product of two axes, read bilinearly (each axis as `_interp`)."""

    xs: list[float]
    ys: list[float]
    values: dict[tuple[float, float], float]
    extrapolate: bool = True

    @classmethod
    def of(cls, points: dict[tuple[float, float], float], what: str, path: str | Path,
           extrapolate: bool = True) -> "_Grid":
        xs, ys = sorted({x for x, _ in points}), sorted({y for _, y in points})
        missing = [(x, y) for x in xs for y in ys if (x, y) not in points]
        if missing:
            raise ValueError(f"{path}: the {what} rows must cover a full grid; missing {missing[:4]}"
                             f"{' ...' if len(missing) > 4 else ''}")
        return cls(xs, ys, points, extrapolate)

    def at(self, x: float, y: float) -> float:
        col = [_interp(self.ys, [self.values[(xi, yi)] for yi in self.ys], y, self.extrapolate) for xi in self.xs]
        return _interp(self.xs, col, x, self.extrapolate)


STEPS_HEADER = ("kind", "prompt_tokens", "decode_seqs", "context", "ms")


@dataclass
class StepProfilePerf(_Base):
    """A measured step profile (`steps.csv` of scripts/profile_steps.py) by step type.

    - prefill only: by the step's prompt tokens (the profile times one prompt of n tokens);
    - decode only: by the number of decoding sequences and their mean context, bilinear;
    - hybrid: prefill(p) + decode(b, context) + a residual measured on a (p, b) grid of hybrid
      steps (what a mixed step costs beyond its parts, usually negative: one fixed step overhead
      fewer), bilinear and held at the grid's edges; zero when the profile has no hybrid rows.
    A decode's context is estimated from the step's KV reads less its prompt tokens (exact when
    every prompt chunk starts at 0, as whole prompts do).
    """

    prefill_tokens: list[float]
    prefill_ms: list[float]
    decode: _Grid
    hybrid_residual: _Grid | None = None
    scale: float = 1.0
    step_costs: StepTypeCosts = StepTypeCosts()

    @classmethod
    def from_csv(cls, path: str | Path, **kw) -> "StepProfilePerf":
        prefill: dict[int, float] = {}
        decode: dict[tuple[float, float], float] = {}
        hybrid: dict[tuple[float, float, float], float] = {}
        with open(path, newline="") as f:
            rows = list(csv.DictReader(f))
        if not rows or tuple(rows[0].keys()) != STEPS_HEADER:
            raise ValueError(f"{path}: not a step profile; expected the header {','.join(STEPS_HEADER)}")
        for line, r in enumerate(rows, start=2):
            try:
                kind, ms = r["kind"], float(r["ms"])
                p, b, c = int(r["prompt_tokens"]), int(r["decode_seqs"]), int(r["context"])
            except (TypeError, ValueError):
                raise ValueError(f"{path}:{line}: bad row {list(r.values())}") from None
            if kind == "prefill" and p > 0:
                prefill[p] = ms
            elif kind == "decode" and b > 0:
                decode[(b, c)] = ms
            elif kind == "hybrid" and p > 0 and b > 0:
                hybrid[(p, b, c)] = ms
            else:
                raise ValueError(f"{path}:{line}: unknown step kind or empty step {list(r.values())}")
        if not prefill or not decode:
            raise ValueError(f"{path}: a step profile needs prefill and decode rows "
                             f"(got {len(prefill)} prefill, {len(decode)} decode)")
        xs = sorted(prefill)
        dec = _Grid.of(decode, "decode", path)
        perf = cls([float(x) for x in xs], [prefill[x] for x in xs], dec, **kw)
        if hybrid:
            residual = {(p, b): ms - perf._prefill_ms(p) - dec.at(b, c) for (p, b, c), ms in hybrid.items()}
            if len(residual) != len(hybrid):
                raise ValueError(f"{path}: hybrid rows measured at more than one context per (prompt, decodes)")
            perf.hybrid_residual = _Grid.of(residual, "hybrid", path, extrapolate=False)
        return perf

    def _prefill_ms(self, n: float) -> float:
        return _interp(self.prefill_tokens, self.prefill_ms, n)

    def step_ms(self, prompt_tokens: int, decode_seqs: int, context: float) -> float:
        """The profile's time of a step with these prompt tokens and decodes of this mean context."""
        if not decode_seqs:
            return self._prefill_ms(prompt_tokens)
        t = self.decode.at(decode_seqs, context)
        if prompt_tokens:
            t += self._prefill_ms(prompt_tokens)
            if self.hybrid_residual is not None:
                t += self.hybrid_residual.at(prompt_tokens, decode_seqs)
        return max(t, 0.0)

    def work_time(self, w: StepWork) -> float:
        if w.num_tokens <= 0:
            return 0.0
        decodes = w.num_tokens - w.num_prompt_tokens
        context = (w.kv_read_tokens - w.num_prompt_tokens) / decodes if decodes else 0.0
        t = self.step_ms(w.num_prompt_tokens, decodes, context) * 1e-3 * self.scale
        return t + self.step_costs.extra(w) if w.num_prompt_tokens else t


def is_step_profile(path: str | Path) -> bool:
    """Whether a profile CSV is a `steps.csv` (by its header) rather than a `tokens,ms` table."""
    with open(path, newline="") as f:
        return f.readline().strip().replace(" ", "").split(",")[:1] == ["kind"]


def make_perf(model: str | ModelSpec, gpu: str | GPU = "L20", tp: int = 1, pp: int = 1,
              profile: str | Path | None = None, **knobs) -> _Base:
    """A roofline for (model, gpu, tp, pp), or a measured profile when `profile` names a CSV: a
    `steps.csv` (header `kind,...`) -> `StepProfilePerf`, a `tokens,ms` table -> `TablePerf`."""
    spec = get_model(model) if isinstance(model, str) else model
    dev = get_gpu(gpu) if isinstance(gpu, str) else gpu
    if isinstance(knobs.get("step_costs"), dict):
        knobs["step_costs"] = StepTypeCosts(**knobs["step_costs"])
    if profile is not None and is_step_profile(profile):
        return StepProfilePerf.from_csv(profile, **knobs)  # measured with real contexts: no extra KV term
    if profile is not None:
        # Knobs override the defaults, e.g. kv_bytes_per_token=0 for a table measured with real contexts.
        return TablePerf.from_csv(profile, **{"kv_bytes_per_token": spec.kv_bytes_per_token / tp,
                                              "kv_bandwidth": dev.mem_bandwidth * dev.bandwidth_efficiency, **knobs})
    if isinstance(knobs.get("link"), str):
        knobs["link"] = get_link(knobs["link"])
    return RooflinePerf(spec, dev, tp=tp, pp=pp, **knobs)
