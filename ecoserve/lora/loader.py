"""Adapters from disk to host memory to device slots, layer by layer, behind the forward pass (AuLoRA's idea).

One background thread does all loading in layer-sized pieces: each piece reads one decoder layer of an
adapter from disk into its host copy (if not there yet), copies it into the adapter's slot (on a side CUDA
stream with one event per layer on a GPU), and publishes "layers < k of this slot are resident". A wrapped
module waits only for its own layer of its own slots, so a step that needs a cold adapter starts at once and
its first layers compute while later layers still load. Between pieces the thread picks the most urgent job
(a step's adapters before prefetches), so a prefetch never delays a step by more than one layer.
"""
from __future__ import annotations

import itertools
import logging
import threading
from dataclasses import dataclass, field
from typing import Callable

import torch

from ecoserve.lora.checkpoint import AdapterCheckpoint, LayerWeights
from ecoserve.lora.layers import LoRALinear, LoRAStep
from ecoserve.request import LoRARequest

logger = logging.getLogger(__name__)

URGENT, PREFETCH = 0, 1  # job priorities: a step waits for the first kind


class HostAdapter:
    """An adapter's weights in host memory, filled layer by layer as they are first read from disk."""

    def __init__(self, lora: LoRARequest, checkpoint: AdapterCheckpoint, num_layers: int, dtype: torch.dtype) -> None:
        self.lora, self.checkpoint, self.dtype = lora, checkpoint, dtype
        self.rank = checkpoint.rank
        self._layers: list[LayerWeights | None] = [None] * num_layers
        self._lock = threading.Lock()

    def layer(self, index: int) -> LayerWeights:
        with self._lock:
            weights = self._layers[index]
            if weights is None:
                weights = self._layers[index] = self.checkpoint.read_layer(index, self.dtype)
            return weights

    def read_all(self) -> None:
        for i in range(len(self._layers)):
            self.layer(i)

    @property
    def complete(self) -> bool:
        return all(w is not None for w in self._layers)


@dataclass(eq=False)
class LoadJob:
    """Bring `host` into `slot` (None: only into host memory), from layer `next_layer` on."""

    host: HostAdapter
    slot: int | None
    priority: int
    order: int
    next_layer: int = 0
    cancelled: bool = False
    done: threading.Event = field(default_factory=threading.Event)


class LayerwiseLoader:
    """The background thread that runs `LoadJob`s one layer at a time, most urgent first."""

    def __init__(self, wrapped: list[dict[str, LoRALinear]], step: LoRAStep, device: torch.device) -> None:
        self.wrapped, self.step, self.device = wrapped, step, device
        self.num_layers = len(wrapped)
        self.before_layer: Callable[[LoadJob, int], None] | None = None  # a hook (tests slow the loader down)
        self._jobs: list[LoadJob] = []
        self._order = itertools.count()
        self._wake = threading.Condition()
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._thread = threading.Thread(target=self._run, name="lora-loader", daemon=True)
        self._thread.start()

    def submit(self, host: HostAdapter, slot: int | None, priority: int) -> LoadJob:
        job = LoadJob(host, slot, priority, next(self._order))
        if slot is not None:
            step = self.step
            with step.changed:
                step.ready[slot], step.failed[slot] = 0, None
                step.layer_events[slot] = []
        with self._wake:
            self._jobs.append(job)
            self._wake.notify()
        return job

    def urge(self, job: LoadJob) -> None:
        """A step needs this (prefetch) job now."""
        with self._wake:
            job.priority = URGENT

    def cancel(self, job: LoadJob) -> None:
        """Stop `job` and wait until its thread no longer touches its slot."""
        job.cancelled = True
        with self._wake:
            if job in self._jobs:
                self._jobs.remove(job)
                job.done.set()
        job.done.wait()

    def _next(self) -> LoadJob:
        with self._wake:
            while not self._jobs:
                self._wake.wait()
            return min(self._jobs, key=lambda j: (j.priority, j.order))

    def _run(self) -> None:
        while True:
            job = self._next()
            layer = job.next_layer
            try:
                if not job.cancelled:
                    self._load_layer(job, layer)
            except BaseException as e:  # a file that vanished or broke after validation: this adapter only
                logger.exception("loading LoRA adapter %r failed", job.host.lora.lora_name)
                self._finish(job, e)
                continue
            job.next_layer = layer + 1
            if job.cancelled or job.next_layer >= self.num_layers:
                self._finish(job, None)

    def _finish(self, job: LoadJob, error: BaseException | None) -> None:
        with self._wake:
            if job in self._jobs:
                self._jobs.remove(job)
        if error is not None and job.slot is not None and not job.cancelled:
            step = self.step
            with step.changed:
                step.failed[job.slot] = error
                step.changed.notify_all()
        job.done.set()

    def _load_layer(self, job: LoadJob, layer: int) -> None:
        hook = self.before_layer
        if hook is not None:
            hook(job, layer)
        weights = job.host.layer(layer)
        slot = job.slot
        if slot is None or job.cancelled:
            return
        step, rank = self.step, job.host.rank
        event = None
        if self._stream is not None:
            with torch.cuda.stream(self._stream):
                for name, module in self.wrapped[layer].items():
                    module.load_slot(slot, weights.get(name), rank, non_blocking=True)
                event = torch.cuda.Event()
                event.record(self._stream)
        else:
            for name, module in self.wrapped[layer].items():
                module.load_slot(slot, weights.get(name), rank)
        with step.changed:
            if job.cancelled:
                return
            if event is not None:
                step.layer_events[slot].append(event)
            step.ready[slot] = layer + 1
            step.changed.notify_all()
