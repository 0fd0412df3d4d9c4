"""Typed engine configuration with vLLM's option names; validation says what would be right."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# --quantization: none (float weights), gguf (a GGUF file's blocks as stored), int8 (Q8_0 of a float checkpoint)
QUANTIZATIONS = ("none", "gguf", "int8")
# --cpu-linear: float32 linears on CPU through torch's F.linear, or oneDNN with prepacked weights; auto
# (the default) packs them where oneDNN is available and the model is loaded whole in one process
CPU_LINEARS = ("auto", "torch", "onednn")


def _need(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


@dataclass
class CacheConfig:
    block_size: int = 16
    # KV budget in bytes; None: num_gpu_blocks decides, or a default of 1 GiB on CPU.
    kv_cache_memory_bytes: int | None = None
    num_gpu_blocks: int | None = None  # explicit block count overrides the byte budget (tests force tiny pools)
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        _need(self.block_size >= 1, f"block_size must be >= 1, got {self.block_size}")
        _need(self.num_gpu_blocks is None or self.num_gpu_blocks >= 1,
              f"num_gpu_blocks must be >= 1, got {self.num_gpu_blocks}")
        _need(self.kv_cache_memory_bytes is None or self.kv_cache_memory_bytes > 0,
              f"kv_cache_memory_bytes must be > 0, got {self.kv_cache_memory_bytes}")


@dataclass
class TDPipeConfig:
    """Knobs of the `tdpipe` policy (TD-Pipe's values by default)."""

    profile: str | None = None  # tokens,ms CSV of this instance; None: the shipped L20 Llama-2-13B profile
    num_stages: int | None = None  # pipeline stages; None: the engine's pipeline_parallel_size (1 alone)
    peak_batch_size: int = 192  # padded tokens per prefill micro-batch; decode batches this big count as saturated
    prefill_kv_fraction: float = 0.9  # stop prefilling once the predicted peak KV use reaches this share of blocks
    predictor: Any = "oracle"  # "oracle" | "constant", or an OutputLengthPredictor (e.g. BucketMeans)
    predictor_noise: float = 0.0  # oracle: relative Gaussian noise
    predictor_constant: int = 256  # constant: the predicted length

    def __post_init__(self) -> None:
        _need(self.num_stages is None or self.num_stages >= 1, f"num_stages must be >= 1, got {self.num_stages}")
        _need(self.peak_batch_size >= 1, f"peak_batch_size must be >= 1, got {self.peak_batch_size}")
        _need(0 < self.prefill_kv_fraction <= 1, f"prefill_kv_fraction must be in (0, 1], got "
                                                 f"{self.prefill_kv_fraction}")


@dataclass
class SchedulerConfig:
    policy: str = "chunked"  # registered names: see ecoserve.sched.policies
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    max_model_len: int | None = None  # None: from the model config
    max_waiting: int | None = None  # waiting-queue limit for servers (None: unbounded)
    tdpipe: TDPipeConfig = field(default_factory=TDPipeConfig)

    def __post_init__(self) -> None:
        _need(self.max_num_batched_tokens >= 1, f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        _need(self.max_num_seqs >= 1, f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        _need(self.max_model_len is None or self.max_model_len >= 1, f"max_model_len must be >= 1, got {self.max_model_len}")
        _need(self.max_waiting is None or self.max_waiting >= 1,
              f"max_waiting (--max-waiting-requests) must be >= 1, got {self.max_waiting}")


@dataclass
class ParallelConfig:
    """How one instance spreads over ranks: tensor parallel inside a stage, pipeline stages in a row."""

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    pp_layer_partition: tuple[int, ...] | None = None  # layers per stage; None: see model.parallel.partition_layers
    max_concurrent_batches: int | None = None  # batches in flight; None: pipeline_parallel_size
    step_timeout_s: float = 120.0  # a step (and every collective) not done by then names the stuck rank
    startup_timeout_s: float = 600.0  # workers must have loaded their shards by then

    def __post_init__(self) -> None:
        _need(self.tensor_parallel_size >= 1, f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        _need(self.pipeline_parallel_size >= 1,
              f"pipeline_parallel_size must be >= 1, got {self.pipeline_parallel_size}")
        _need(self.max_concurrent_batches is None or self.max_concurrent_batches >= 1,
              f"max_concurrent_batches must be >= 1, got {self.max_concurrent_batches}")
        _need(self.step_timeout_s > 0 and self.startup_timeout_s > 0, "step_timeout_s and startup_timeout_s must be > 0")
        if isinstance(self.pp_layer_partition, str):
            try:
                self.pp_layer_partition = tuple(int(x) for x in self.pp_layer_partition.split(","))
            except ValueError:
                raise ValueError(f"pp_layer_partition must be comma-separated layer counts such as 12,11, got "
                                 f"{self.pp_layer_partition!r}") from None
        if self.pp_layer_partition is not None:
            self.pp_layer_partition = tuple(self.pp_layer_partition)
            _need(len(self.pp_layer_partition) == self.pipeline_parallel_size,
                  f"pp_layer_partition gives {len(self.pp_layer_partition)} stages, pipeline_parallel_size is "
                  f"{self.pipeline_parallel_size}")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def batches_in_flight(self) -> int:
        return self.max_concurrent_batches or self.pipeline_parallel_size


@dataclass
class EngineConfig:
    """Everything `LLM(...)` / `ecoserve serve` accept."""

    model: str | None = None  # local dir, hub id or .gguf path; None: the embedded default
    tokenizer: str | None = None
    dtype: str = "auto"  # auto (float32 on CPU) | float32 | bfloat16 | float16
    quantization: str | None = None  # None/none: float weights | gguf: keep GGUF blocks | int8: Q8_0 weights (CPU)
    cpu_linear: str = "auto"  # float32 linears on CPU: auto | torch (F.linear) | onednn (prepacked oneDNN weights)
    device: str = "cpu"
    seed: int = 0
    num_threads: int | None = None  # torch intra-op threads on CPU
    revision: str | None = None
    skip_tokenizer_init: bool = False  # token-id prompts and outputs only: no tokenizer is loaded
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    def __post_init__(self) -> None:
        _need(self.dtype in ("auto", "float32", "bfloat16", "float16"),
              f"dtype must be one of auto, float32, bfloat16, float16; got {self.dtype!r}")
        _need(self.cpu_linear in CPU_LINEARS, f"cpu_linear must be one of {', '.join(CPU_LINEARS)}; "
                                              f"got {self.cpu_linear!r}")
        _need(self.quantization is None or self.quantization in QUANTIZATIONS,
              f"quantization must be one of {', '.join(QUANTIZATIONS)}; got {self.quantization!r}")
