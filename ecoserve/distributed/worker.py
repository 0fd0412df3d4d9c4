"""One rank of a parallel instance: its layer slice, weight shards and KV cache, in its own process.

The worker loads only its shard, then executes `StepInput`s in the order they arrive on its
control pipe with the engine's one `ModelRunner`. Every rank acknowledges every step (the output
rank with the sampled tokens), and a daemon thread stamps a shared heartbeat slot so the driver
can tell a stopped process from one that waits on a stopped peer.
"""
from __future__ import annotations

import os
import threading
import time
import traceback
from dataclasses import dataclass

import torch

from ecoserve.distributed.comm import Topology, init_distributed
from ecoserve.distributed.step import StepInput, WorkerRequests

HEARTBEAT_INTERVAL_S = 0.1


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker needs to build its shard; pickled to the spawned process."""

    model_path: str
    dtype: str
    device: str
    topology: Topology
    layer_bounds: tuple[tuple[int, int], ...]  # per stage [start, end)
    num_blocks: int
    block_size: int
    seed: int
    max_model_len: int
    port: int
    collective_timeout_s: float
    num_threads: int | None = 1
    kv_cache_dtype: str = "auto"  # --kv-cache-dtype
    expert_parallel: bool = False  # --enable-expert-parallel


@dataclass(frozen=True)
class StepDone:
    rank: int
    step_id: int
    result: object  # StepResult on the output rank, None elsewhere


@dataclass(frozen=True)
class WorkerFailed:
    rank: int
    error: str


def _heartbeat(slots, rank: int) -> None:
    while True:
        slots[rank] = time.monotonic()
        time.sleep(HEARTBEAT_INTERVAL_S)


def build_runner(spec: WorkerSpec, rank: int):
    """Join the process groups, load this rank's shard and wrap it in a ModelRunner."""
    from ecoserve.engine.kv_cache import resolve_cache_dtype
    from ecoserve.engine.model_runner import ModelRunner
    from ecoserve.model.loader import build_model, resolve_dtype
    from ecoserve.model.parallel import ShardPlan
    from ecoserve.model.spec import ModelSpec
    from pathlib import Path

    topo = spec.topology
    stage, tp_rank = topo.coords(rank)
    device = spec.device
    if torch.device(device).type == "cuda":
        device = f"cuda:{rank % max(torch.cuda.device_count(), 1)}"
        torch.cuda.set_device(device)
    tp, link = init_distributed(topo, rank, spec.port, device, spec.collective_timeout_s)
    model_spec = ModelSpec.from_dir(spec.model_path)
    start, end = spec.layer_bounds[stage]
    shard = ShardPlan(tp_rank, topo.tp, stage, topo.pp, start, end, spec.expert_parallel)
    dtype = resolve_dtype(spec.dtype, device, model_spec.torch_dtype)
    model = build_model(model_spec, Path(spec.model_path), dtype, device, shard, tp, link)
    model.ensure_positions(spec.max_model_len)
    return ModelRunner(model, spec.num_blocks, spec.block_size, device, spec.seed,
                       resolve_cache_dtype(spec.kv_cache_dtype, dtype)), link


def worker_main(spec: WorkerSpec, rank: int, conn, heartbeats) -> None:
    threading.Thread(target=_heartbeat, args=(heartbeats, rank), daemon=True).start()
    if spec.num_threads:
        torch.set_num_threads(spec.num_threads)
    link = None
    try:
        runner, link = build_runner(spec, rank)
        is_output = rank == spec.topology.output_rank
        state = WorkerRequests()
        conn.send(StepDone(rank, -1, None))  # ready
        while True:
            step: StepInput | None = conn.recv()
            if step is None:
                break
            result = runner.execute(state.apply(step), step.masks)
            conn.send(StepDone(rank, step.step_id, result if is_output else None))
        if link is not None:
            link.flush()
    except (EOFError, KeyboardInterrupt, BrokenPipeError):
        pass  # the driver went away: nothing to report to
    except BaseException:
        try:
            conn.send(WorkerFailed(rank, traceback.format_exc(limit=8)))
        except Exception:
            pass
    finally:
        conn.close()
        os._exit(0)  # skip process-group teardown, which may block on a dead peer
