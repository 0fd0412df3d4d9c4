"""The engine's LoRA adapters: which are registered, which sit in host memory, which hold a device slot.

Three levels, each an LRU: registered adapters (name -> `LoRARequest`, validated when registered), the host
cache (`max_cpu_loras` adapters' weights), and `max_loras` device slots. `begin_step` (called by the model
runner) gives every adapter of the batch a slot, starting layer-wise loads for those that lack one, and sets
the token -> slot segments the wrapped modules read; `prefetch` (called by the engine each step) starts
loading the adapters of waiting requests into slots no running request needs.
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, Sequence

import torch
from torch import nn

from ecoserve.config import LoRAConfig
from ecoserve.lora.checkpoint import AdapterCheckpoint, LoRAAdapterError
from ecoserve.lora.layers import LoRAStep, Segment, model_targets, wrap_model
from ecoserve.lora.loader import PREFETCH, URGENT, HostAdapter, LayerwiseLoader, LoadJob
from ecoserve.request import LoRARequest

if TYPE_CHECKING:
    from ecoserve.sched.interface import ScheduledChunk

logger = logging.getLogger(__name__)


@dataclass
class LoRAStats:
    """vLLM's `lora_requests_info` (running / waiting adapter names, max_lora) and load/eviction counters."""

    running_lora_adapters: list[str]
    waiting_lora_adapters: list[str]
    max_lora: int
    num_loads: int  # adapters read from disk into host memory
    num_evictions: int  # adapters dropped from host memory (max_cpu_loras)
    num_slot_loads: int  # adapters loaded into a device slot
    num_slot_evictions: int  # adapters that lost their device slot to another


class LoRAManager:
    def __init__(self, model: nn.Module, config: LoRAConfig, model_name: str) -> None:
        self.config = config
        self.targets = model_targets(model, model_name)
        self.dtype = model.dtype
        self.step = LoRAStep(config.max_loras)
        self.wrapped = wrap_model(model, self.targets, config.max_loras, config.max_lora_rank, self.step)
        self.loader = LayerwiseLoader(self.wrapped, self.step, model.device)
        self.layerwise = True  # False: a step waits until its adapters are wholly resident (for comparison)
        self._registered: OrderedDict[str, LoRARequest] = OrderedDict()
        self._host: OrderedDict[int, HostAdapter] = OrderedDict()  # lora_int_id -> weights, least recent first
        self._slot_of: OrderedDict[int, int] = OrderedDict()  # lora_int_id -> slot, least recently used first
        self._slot_ids: list[int | None] = [None] * config.max_loras
        self._slot_jobs: list[LoadJob | None] = [None] * config.max_loras
        self._host_jobs: dict[int, LoadJob] = {}  # background reads into host memory only (prefetch)
        self.num_loads = self.num_evictions = self.num_slot_loads = self.num_slot_evictions = 0

    # ---- registration ----------------------------------------------------------------------
    def register(self, lora: LoRARequest) -> None:
        """Validate an adapter and register it under its name; its weights are read later, layer by layer.

        Registering the same request again is a no-op; a name or id already used by another adapter is an error.
        """
        known = self._registered.get(lora.lora_name)
        if known is not None:
            if known != lora:
                raise LoRAAdapterError(f"a LoRA adapter named {lora.lora_name!r} is already registered (id "
                                       f"{known.lora_int_id}, path {known.lora_path}); remove it first")
            return
        clash = next((r for r in self._registered.values() if r.lora_int_id == lora.lora_int_id), None)
        if clash is not None:
            raise LoRAAdapterError(f"lora_int_id {lora.lora_int_id} is already used by adapter "
                                   f"{clash.lora_name!r}; each adapter needs its own id")
        self._host_adapter(lora)  # opens and validates the checkpoint
        self._registered[lora.lora_name] = lora

    def add_lora(self, lora: LoRARequest) -> None:
        """Register and read the whole adapter into the host cache now (a later first request needs no disk)."""
        self.register(lora)
        self._host_adapter(lora).read_all()

    def remove_lora(self, name: str) -> bool:
        """Forget an adapter and drop its host weights; requests already using it finish (their adapter is
        registered again on their next step if it lost its slot). False if no adapter has that name."""
        lora = self._registered.pop(name, None)
        if lora is None:
            return False
        self._host.pop(lora.lora_int_id, None)
        slot = self._slot_of.get(lora.lora_int_id)
        if slot is not None:
            self._slot_of.move_to_end(lora.lora_int_id, last=False)  # the first slot to reuse
        return True

    def list_loras(self) -> list[LoRARequest]:
        return list(self._registered.values())

    def _host_adapter(self, lora: LoRARequest) -> HostAdapter:
        """The adapter's host cache entry (opened and validated if absent: evicting the least recent beyond
        max_cpu_loras)."""
        host = self._host.get(lora.lora_int_id)
        if host is not None and host.lora == lora:
            self._host.move_to_end(lora.lora_int_id)
            return host
        checkpoint = AdapterCheckpoint(lora.lora_path, self.targets, self.config.max_lora_rank, lora.base_model_name)
        host = HostAdapter(lora, checkpoint, self.targets.num_layers, self.dtype)
        self._host[lora.lora_int_id] = host
        self.num_loads += 1
        while len(self._host) > self.config.max_cpu_loras:
            evicted, _ = self._host.popitem(last=False)
            self.num_evictions += 1
            logger.debug("LoRA adapter %d left the host cache", evicted)
        return host

    # ---- device slots --------------------------------------------------------------------
    def resident(self) -> list[str]:
        """Names of the adapters that hold a device slot (loaded or loading)."""
        names = {r.lora_int_id: r.lora_name for r in self._registered.values()}
        return [names.get(i, str(i)) for i in self._slot_of]

    def begin_step(self, chunks: Sequence["ScheduledChunk"]) -> None:
        """Give each adapter of the batch a slot and set the segments the wrapped modules read."""
        runs: dict[int, list[tuple[int, int]]] = {}
        needed: dict[int, LoRARequest] = {}
        offset = 0
        for chunk in chunks:
            lora = chunk.request.lora_request
            n = chunk.num_tokens
            if lora is not None:
                needed.setdefault(lora.lora_int_id, lora)
                spans = runs.setdefault(lora.lora_int_id, [])
                if spans and spans[-1][1] == offset:
                    spans[-1] = (spans[-1][0], offset + n)
                else:
                    spans.append((offset, n + offset))
            offset += n
        step = self.step
        if not needed:
            if step.segments:
                step.set_segments([], 0)
            return
        segments = []
        for lora_id, lora in needed.items():
            slot = self._slot_for(lora, needed)
            spans = runs[lora_id]
            if len(spans) == 1:
                rows: slice | torch.Tensor = slice(*spans[0])
            else:
                rows = torch.cat([torch.arange(a, b) for a, b in spans]).to(self.loader.device)
            segments.append(Segment(slot, self._host_rank(slot), rows))
        if not self.layerwise:
            for seg in segments:
                step.wait(seg.slot, self.targets.num_layers - 1)  # a failure shows in take_failed
        segments.sort(key=lambda seg: seg.slot)
        step.set_segments(segments, offset)

    def _host_rank(self, slot: int) -> int:
        job = self._slot_jobs[slot]
        return job.host.rank

    def _slot_for(self, lora: LoRARequest, protected: dict[int, LoRARequest]) -> int:
        slot = self._slot_of.get(lora.lora_int_id)
        job = self._slot_jobs[slot] if slot is not None else None
        if slot is not None and job.host.lora == lora:
            self._slot_of.move_to_end(lora.lora_int_id)
            if job.priority != URGENT:
                self.loader.urge(job)
            return slot
        return self._load(lora, self._free_slot(protected) if slot is None else slot, URGENT)

    def _free_slot(self, protected: Iterable[int]) -> int | None:
        """An empty slot, else the least recently used one whose adapter is not `protected`; None if none."""
        for slot, lora_id in enumerate(self._slot_ids):
            if lora_id is None:
                return slot
        keep = set(protected)
        return next((slot for lora_id, slot in self._slot_of.items() if lora_id not in keep), None)

    def _load(self, lora: LoRARequest, slot: int | None, priority: int) -> int:
        if slot is None:
            raise RuntimeError("no LoRA slot is free for this step: more adapters in one batch than max_loras")
        if lora.lora_name not in self._registered:
            self.register(lora)  # removed while its requests ran, or never added: registered on use
        host = self._host_adapter(lora)
        old_job, old_id = self._slot_jobs[slot], self._slot_ids[slot]
        if old_job is not None:
            self.loader.cancel(old_job)
        if old_id is not None:
            del self._slot_of[old_id]
            self.num_slot_evictions += 1
        self._slot_ids[slot] = lora.lora_int_id
        self._slot_of[lora.lora_int_id] = slot
        self.step.versions[slot] += 1  # stacked copies of the slot's old adapter are stale
        self._slot_jobs[slot] = self.loader.submit(host, slot, priority)
        self.num_slot_loads += 1
        return slot

    def prefetch(self, waiting: Iterable[LoRARequest | None], running: Iterable[int]) -> None:
        """Start loading the adapters of waiting requests (in queue order) into slots that no running request's
        adapter holds; adapters that get no slot are read into host memory in the background."""
        keep = set(running)
        for lora in waiting:
            if lora is None or lora.lora_int_id in keep:
                continue
            keep.add(lora.lora_int_id)
            slot = self._slot_of.get(lora.lora_int_id)
            if slot is not None and self._slot_jobs[slot].host.lora == lora:
                continue
            try:
                free = self._free_slot(keep) if slot is None else slot
                if free is not None:
                    self._load(lora, free, PREFETCH)
                    continue
                host = self._host_adapter(lora)
                pending = self._host_jobs.get(lora.lora_int_id)
                if not host.complete and (pending is None or pending.done.is_set()):
                    self._host_jobs[lora.lora_int_id] = self.loader.submit(host, None, PREFETCH)
            except LoRAAdapterError:
                logger.warning("prefetching LoRA adapter %r failed; its request will fail when scheduled",
                               lora.lora_name, exc_info=True)

    def take_failed(self) -> list[tuple[LoRARequest, BaseException]]:
        """Adapters whose load failed after they were validated (a file changed or vanished), each with its error;
        their slot is freed and they are forgotten, so the next request that names one validates it again."""
        failed = []
        step = self.step
        for slot, error in enumerate(step.failed):
            if error is None:
                continue
            lora = self._slot_jobs[slot].host.lora
            failed.append((lora, error))
            with step.changed:
                step.failed[slot], step.ready[slot] = None, 0
            del self._slot_of[self._slot_ids[slot]]
            self._slot_ids[slot] = self._slot_jobs[slot] = None
            self._host.pop(lora.lora_int_id, None)
            if self._registered.get(lora.lora_name) == lora:
                del self._registered[lora.lora_name]
        return failed

    def stats(self, running: Iterable[LoRARequest | None], waiting: Iterable[LoRARequest | None]) -> LoRAStats:
        def names(loras):
            return sorted({r.lora_name for r in loras if r is not None})

        return LoRAStats(names(running), names(waiting), self.config.max_loras, self.num_loads, self.num_evictions,
                         self.num_slot_loads, self.num_slot_evictions)
