"""Start the workers of a parallel instance from an engine config (local processes)."""
from __future__ import annotations

from ecoserve.config import EngineConfig
from ecoserve.distributed.comm import Topology, free_port
from ecoserve.distributed.executor import MultiprocExecutor
from ecoserve.distributed.worker import WorkerSpec
from ecoserve.model.moe import ExpertShard
from ecoserve.model.parallel import HeadShard, partition_layers


def start_workers(config: EngineConfig, loaded, num_blocks: int, max_model_len: int) -> MultiprocExecutor:
    """One process per rank, each loading its own shard; validated here first so errors come early."""
    parallel, spec = config.parallel, loaded.spec
    stages = partition_layers(spec.num_layers, parallel.pipeline_parallel_size, parallel.pp_layer_partition)
    HeadShard.of(spec, parallel.tensor_parallel_size, 0)  # raises on a tp that does not divide the heads
    has_dense_mlp = spec.moe is None or bool(spec.moe.dense_layers)
    if has_dense_mlp and spec.intermediate_size % parallel.tensor_parallel_size:
        raise ValueError(f"tensor_parallel_size {parallel.tensor_parallel_size} must divide intermediate_size "
                         f"{spec.intermediate_size}")
    if spec.moe is not None:
        ExpertShard.of(spec.moe, parallel.tensor_parallel_size, 0, parallel.enable_expert_parallel)
    worker = WorkerSpec(
        model_path=str(loaded.path), dtype=config.dtype, device=config.device,
        topology=Topology(parallel.tensor_parallel_size, parallel.pipeline_parallel_size),
        layer_bounds=tuple((r.start, r.stop) for r in stages), num_blocks=num_blocks,
        block_size=config.cache.block_size, seed=config.seed, max_model_len=max_model_len, port=free_port(),
        collective_timeout_s=parallel.step_timeout_s, num_threads=config.num_threads or 1,
        kv_cache_dtype=config.cache.cache_dtype, expert_parallel=parallel.enable_expert_parallel)
    return MultiprocExecutor(worker, parallel.step_timeout_s, parallel.startup_timeout_s)
