"""Typed engine configuration with vLLM's option names; validation says what would be right."""
from __future__ import annotations

from dataclasses import dataclass, field


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
class SchedulerConfig:
    policy: str = "chunked"  # registered names: see ecoserve.sched.policies
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    max_model_len: int | None = None  # None: from the model config
    max_waiting: int | None = None  # waiting-queue limit for servers (None: unbounded)

    def __post_init__(self) -> None:
        _need(self.max_num_batched_tokens >= 1, f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        _need(self.max_num_seqs >= 1, f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        _need(self.max_model_len is None or self.max_model_len >= 1, f"max_model_len must be >= 1, got {self.max_model_len}")
        _need(self.max_waiting is None or self.max_waiting >= 1,
              f"max_waiting (--max-waiting-requests) must be >= 1, got {self.max_waiting}")


@dataclass
class EngineConfig:
    """Everything `LLM(...)` / `ecoserve serve` accept."""

    model: str | None = None  # local dir, hub id or .gguf path; None: the embedded default
    tokenizer: str | None = None
    dtype: str = "auto"  # auto (float32 on CPU) | float32 | bfloat16 | float16
    quantization: str | None = None  # None/auto: GGUF stays quantized on CPU | none | gguf | int8 (Q8_0 weights)
    device: str = "cpu"
    seed: int = 0
    num_threads: int | None = None  # torch intra-op threads on CPU
    revision: str | None = None
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)

    def __post_init__(self) -> None:
        _need(self.dtype in ("auto", "float32", "bfloat16", "float16"),
              f"dtype must be one of auto, float32, bfloat16, float16; got {self.dtype!r}")
        _need(self.quantization in (None, "auto", "none", "gguf", "int8"),
              f"quantization must be one of auto, none, gguf, int8; got {self.quantization!r}")
