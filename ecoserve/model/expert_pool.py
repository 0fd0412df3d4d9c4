"""The expert pool: a host store of every expert and a bounded device pool, placed by `ecoserve.moe`.

`ExpertPool.attach(model, resident_experts)` takes the stacked expert weights of each sparse MoE block
into host memory (pinned on CUDA) and gives the block a device pool of `resident_experts` slots. Each
forward pass of a block then (1) counts its routed tokens per expert (the popularity estimate), (2) asks
`PlacementPolicy.plan_layer` which routed experts are resident hits, which are loaded on demand (into a
slot, or a transient buffer when no slot may be freed) and which are computed on the host where their
weights live, (3) runs each group with `fused_experts` and sums the three partial outputs, and (4) queues
prefetches: the next layer's experts its router predicts from this layer's input, then the popular
experts a layer lacks, copied on a side CUDA stream. On CPU both tiers are the same memory: the
decisions, the copies and the counts are real, only cheap.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import asdict, dataclass
from typing import Iterable

import torch
from torch import nn

from ecoserve.model.moe import SparseMoeBlock, fused_experts
from ecoserve.moe import CostTable, ExpertPopularity, MeasuredCost, PlacementPolicy, PrefetchQueue


@dataclass
class PoolStats:
    """Counts since the pool was built (per routed expert and layer, not per token)."""

    hits: int = 0  # routed experts already resident
    loads: int = 0  # routed experts moved on demand
    host_computed: int = 0  # routed experts computed in host memory
    prefetches: int = 0  # experts moved ahead of need
    evictions: int = 0
    bytes_moved: int = 0  # host -> device

    def as_dict(self) -> dict:
        return asdict(self)


class _LayerExperts:
    """What a block calls in place of its own expert compute."""

    def __init__(self, pool: "ExpertPool", layer: int) -> None:
        self.pool, self.layer = pool, layer

    def __call__(self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return self.pool.experts(self.layer, x, expert_ids, weights)


class ExpertPool:
    def __init__(self, blocks: list[SparseMoeBlock], resident_experts: int, costs: CostTable | None = None,
                 popularity_decay: float = 0.9, prefetch: bool = True) -> None:
        if not blocks:
            raise ValueError("--moe-resident-experts needs a mixture-of-experts model; this one has no sparse layers")
        first = blocks[0]
        if first.shard.num_local_experts != first.moe.num_experts or first.tp is not None:
            raise ValueError("--moe-resident-experts runs in a single-process instance (no tensor or expert parallel)")
        num_experts = first.moe.num_experts
        if not 0 <= resident_experts <= num_experts:
            raise ValueError(f"--moe-resident-experts must be in [0, {num_experts}] (experts per layer), "
                             f"got {resident_experts}")
        self.blocks, self.budget, self.num_experts = blocks, resident_experts, num_experts
        self.device = first.w_gate_up.device
        self.on_cuda = self.device.type == "cuda"
        # host store: the blocks' stacked weights, in (pinned) host memory; the blocks keep them as parameters
        for block in blocks:
            block.unpack_experts()  # the pool copies plain expert slices between its tiers
            for p in (block.w_gate_up, block.w_down):
                p.data = p.data.to("cpu").pin_memory() if self.on_cuda else p.data
        self.expert_bytes = (first.w_gate_up[0].numel() + first.w_down[0].numel()) * first.w_gate_up.element_size()
        self.slots_gate_up = [torch.empty((resident_experts, *b.w_gate_up.shape[1:]), dtype=b.w_gate_up.dtype,
                                          device=self.device) for b in blocks]
        self.slots_down = [torch.empty((resident_experts, *b.w_down.shape[1:]), dtype=b.w_down.dtype,
                                       device=self.device) for b in blocks]
        self.slot_of: list[dict[int, int]] = [{} for _ in blocks]
        self.free: list[list[int]] = [list(range(resident_experts - 1, -1, -1)) for _ in blocks]
        self._lut = [torch.full((num_experts,), -1, dtype=torch.long, device=self.device) for _ in blocks]
        self.popularity = ExpertPopularity(len(blocks), num_experts, popularity_decay)
        self.policy = PlacementPolicy(len(blocks), num_experts, resident_experts, costs or self.measure_costs(),
                                      self.popularity)
        self.queue = PrefetchQueue()
        self.prefetch = prefetch
        self.stats = PoolStats()
        self._load_stream = torch.cuda.Stream(self.device) if self.on_cuda else None
        for layer in range(len(blocks)):  # start with experts 0..budget-1 (no popularity yet)
            for e in range(resident_experts):
                self._copy_in(layer, e, self.free[layer].pop())
        self.stats = PoolStats()  # the initial fill is not traffic of the workload
        for layer, block in enumerate(blocks):
            block.expert_pool = _LayerExperts(self, layer)

    @classmethod
    def attach(cls, model: nn.Module, resident_experts: int, **kw) -> "ExpertPool":
        """A pool over every sparse MoE block of `model`, in layer order."""
        return cls([m for m in model.modules() if isinstance(m, SparseMoeBlock)], resident_experts, **kw)

    # -- placement ------------------------------------------------------------------------------------------
    def resident(self, layer: int) -> frozenset[int]:
        return frozenset(self.slot_of[layer])

    def _copy_in(self, layer: int, expert: int, slot: int) -> None:
        block = self.blocks[layer]
        with self._on_load_stream():
            self.slots_gate_up[layer][slot].copy_(block.w_gate_up.data[expert], non_blocking=True)
            self.slots_down[layer][slot].copy_(block.w_down.data[expert], non_blocking=True)
        self.slot_of[layer][expert] = slot
        self._lut[layer][expert] = slot
        self.stats.bytes_moved += self.expert_bytes

    def _evict(self, layer: int, expert: int) -> int:
        slot = self.slot_of[layer].pop(expert)
        self._lut[layer][expert] = -1
        self.stats.evictions += 1
        return slot

    def _on_load_stream(self):
        """Copies go on the side stream, after the compute already queued (which may still read a slot)."""
        if self._load_stream is None:
            return contextlib.nullcontext()
        self._load_stream.wait_stream(torch.cuda.current_stream(self.device))
        return torch.cuda.stream(self._load_stream)

    def _wait_for_loads(self) -> None:
        if self._load_stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self._load_stream)

    # -- compute --------------------------------------------------------------------------------------------
    def experts(self, layer: int, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        counts = torch.bincount(expert_ids.flatten(), minlength=self.num_experts).tolist()
        self.popularity.observe(layer, counts)
        plan = self.policy.plan_layer(layer, counts, self.slot_of[layer].keys())
        victims = iter(plan.evict)
        for e in plan.admit:
            self.queue.discard(layer, e)
            slot = self.free[layer].pop() if self.free[layer] else self._evict(layer, next(victims))
            self._copy_in(layer, e, slot)
        transient = [e for e in plan.load if e not in plan.admit]
        self.stats.hits += len(plan.hits)
        self.stats.loads += len(plan.load)
        self.stats.host_computed += len(plan.host)
        block = self.blocks[layer]
        parts = []
        if transient:
            idx = torch.tensor(transient)
            gate_up = torch.empty((len(transient), *block.w_gate_up.shape[1:]), dtype=block.w_gate_up.dtype,
                                  device=self.device)  # allocated on the compute stream, which reads it
            down = torch.empty((len(transient), *block.w_down.shape[1:]), dtype=block.w_down.dtype, device=self.device)
            with self._on_load_stream():
                gate_up.copy_(block.w_gate_up.data[idx], non_blocking=True)
                down.copy_(block.w_down.data[idx], non_blocking=True)
            self.stats.bytes_moved += len(transient) * self.expert_bytes
            lut = torch.full((self.num_experts,), -1, dtype=torch.long, device=self.device)
            lut[torch.tensor(transient, device=self.device)] = torch.arange(len(transient), device=self.device)
            parts.append((lut, gate_up, down))
        self._wait_for_loads()
        out = None
        if plan.hits or plan.admit:
            out = fused_experts(x, self._lut[layer][expert_ids], weights, self.slots_gate_up[layer],
                                self.slots_down[layer])
        for lut, gate_up, down in parts:
            y = fused_experts(x, lut[expert_ids], weights, gate_up, down)
            out = y if out is None else out + y
        if plan.host:
            keep = torch.zeros(self.num_experts, dtype=torch.bool)
            keep[list(plan.host)] = True
            ids = expert_ids.to("cpu")
            host_ids = torch.where(keep[ids], ids, torch.full_like(ids, -1))
            y = fused_experts(x.to("cpu"), host_ids, weights.to("cpu"), block.w_gate_up.data, block.w_down.data)
            y = y.to(self.device, non_blocking=True)
            out = y if out is None else out + y
        if out is None:
            out = torch.zeros_like(x)
        if self.prefetch:
            self._prefetch_after(layer, x)
        return out

    # -- prefetch -------------------------------------------------------------------------------------------
    def _prefetch_after(self, layer: int, x: torch.Tensor) -> None:
        """Queue the next layer's predicted experts and the missing popular ones; move a few of them now."""
        nxt = layer + 1 if layer + 1 < len(self.blocks) else None
        predicted: list[int] = []
        if nxt is not None and self.budget:
            block = self.blocks[nxt]
            ids = torch.topk(block.gate(x), block.moe.top_k, dim=-1).indices  # the next router on this input
            counts = torch.bincount(ids.flatten(), minlength=self.num_experts).tolist()
            predicted = sorted((e for e, n in enumerate(counts) if n), key=lambda e: (-counts[e], e))[:self.budget]
        resident = {i: self.slot_of[i].keys() for i in range(len(self.blocks))}
        self.policy.enqueue_prefetch(self.queue, nxt, predicted, resident)
        self._drain(max(1, self.budget // 4), keep={nxt: set(predicted)} if nxt is not None else {})

    def _drain(self, limit: int, keep: dict[int, set[int]]) -> None:
        moved = 0
        while moved < limit:
            item = self.queue.pop()
            if item is None:
                return
            layer, e, priority = item
            if e in self.slot_of[layer]:
                continue
            if self.free[layer]:
                slot = self.free[layer].pop()
            else:
                victim = self.policy.victim(layer, e, self.slot_of[layer].keys(), keep.get(layer, ()), priority)
                if victim is None:
                    continue
                slot = self._evict(layer, victim)
            self._copy_in(layer, e, slot)
            self.stats.prefetches += 1
            moved += 1

    # -- cost table -----------------------------------------------------------------------------------------
    def measure_costs(self, token_counts: Iterable[int] = (1, 8, 64, 256), reps: int = 3) -> CostTable:
        """Time one expert on each tier by tokens, and one host -> device copy (the policy's cost table)."""
        block = self.blocks[0]
        host_gu, host_d = block.w_gate_up.data[:1], block.w_down.data[:1]
        dev_gu, dev_d = host_gu.to(self.device), host_d.to(self.device)
        hidden = host_gu.shape[-1]

        def timed(fn) -> float:  # the fastest of `reps`: noise only ever adds time
            fn()
            best = float("inf")
            for _ in range(reps):
                self._sync()
                t0 = time.perf_counter()
                fn()
                self._sync()
                best = min(best, time.perf_counter() - t0)
            return best

        host, dev = [], []
        for n in token_counts:
            ids, w = torch.zeros(n, 1, dtype=torch.long), torch.ones(n, 1, dtype=host_gu.dtype)
            xh = torch.randn(n, hidden, dtype=host_gu.dtype)
            host.append((n, timed(lambda: fused_experts(xh, ids, w, host_gu, host_d))))
            xd, idd, wd = xh.to(self.device), ids.to(self.device), w.to(self.device)
            dev.append((n, timed(lambda: fused_experts(xd, idd, wd, dev_gu, dev_d))))
        load = timed(lambda: (dev_gu.copy_(host_gu, non_blocking=True), dev_d.copy_(host_d, non_blocking=True)))
        return CostTable(MeasuredCost.of(host), MeasuredCost.of(dev), max(load, 1e-9))

    def _sync(self) -> None:
        if self.on_cuda:
            torch.cuda.synchronize(self.device)

