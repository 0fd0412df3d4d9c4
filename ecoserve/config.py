"""Typed engine configuration with vLLM's option names; validation says what would be right.

`EngineArgs` is the one list of engine options, flat as users pass them (`LLM(model, **kwargs)`, the
command-line flags, the flags that start a cluster instance); `create_engine_config` sorts them into
the typed configs below, which hold the defaults.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Collection

# --quantization: none (float weights), gguf (a GGUF file's blocks as stored), int8 (Q8_0 of a float checkpoint),
# w8a8 (per-channel int8 weights, per-token int8 activations)
QUANTIZATIONS = ("none", "gguf", "int8", "w8a8")
# --cpu-linear: float32 and bfloat16 linears on CPU through torch's F.linear, or oneDNN with prepacked weights;
# auto (the default) packs them where oneDNN is available and the model is loaded whole in one process
CPU_LINEARS = ("auto", "torch", "onednn")
DTYPES = ("auto", "float32", "bfloat16", "float16")
# --kv-cache-dtype: the element type of the KV cache; auto: the model's dtype
KV_CACHE_DTYPES = ("auto", "bfloat16", "float32")


def _need(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def check_quantize_lm_head(quantization: str | None, quantize_lm_head: bool) -> None:
    """`--quantize-lm-head` only says something under `--quantization w8a8` (the other quantizations take the
    LM head with the rest): refuse it elsewhere rather than ignore it."""
    _need(not quantize_lm_head or quantization == "w8a8",
          f"quantize_lm_head (--quantize-lm-head) needs quantization w8a8; got quantization {quantization!r}")


@dataclass
class CacheConfig:
    block_size: int = 16
    # KV budget in bytes; None: num_gpu_blocks decides, or a default of 1 GiB on CPU.
    kv_cache_memory_bytes: int | None = None
    num_gpu_blocks: int | None = None  # explicit block count overrides the byte budget (tests force tiny pools)
    enable_prefix_caching: bool = True
    cache_dtype: str = "auto"  # KV element type: auto (the model's dtype) | bfloat16 | float32

    def __post_init__(self) -> None:
        _need(self.block_size >= 1, f"block_size must be >= 1, got {self.block_size}")
        _need(self.cache_dtype in KV_CACHE_DTYPES, f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}; "
                                                   f"got {self.cache_dtype!r}")
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


def parse_layer_counts(text: str) -> tuple[int, ...]:
    """`12,11` -> (12, 11): layers per pipeline stage."""
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"pp_layer_partition must be comma-separated layer counts such as 12,11, got "
                         f"{text!r}") from None


@dataclass
class ParallelConfig:
    """How one instance spreads over ranks: tensor parallel inside a stage, pipeline stages in a row."""

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    pp_layer_partition: tuple[int, ...] | None = None  # layers per stage; None: see model.parallel.partition_layers
    max_concurrent_batches: int | None = None  # batches in flight; None: pipeline_parallel_size
    step_timeout_s: float = 120.0  # a step (and every collective) not done by then names the stuck rank
    startup_timeout_s: float = 600.0  # workers must have loaded their shards by then
    enable_expert_parallel: bool = False  # MoE layers: the tensor-parallel ranks split the experts, not each expert

    def __post_init__(self) -> None:
        _need(self.tensor_parallel_size >= 1, f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        _need(self.pipeline_parallel_size >= 1,
              f"pipeline_parallel_size must be >= 1, got {self.pipeline_parallel_size}")
        _need(self.max_concurrent_batches is None or self.max_concurrent_batches >= 1,
              f"max_concurrent_batches must be >= 1, got {self.max_concurrent_batches}")
        _need(self.step_timeout_s > 0 and self.startup_timeout_s > 0, "step_timeout_s and startup_timeout_s must be > 0")
        if isinstance(self.pp_layer_partition, str):
            self.pp_layer_partition = parse_layer_counts(self.pp_layer_partition)
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
class StructuredOutputsConfig:
    """Grammar compilation: a request waits (unscheduled) for its grammar at most `compile_timeout_s`, then fails
    alone; `cache_size` distinct grammars stay compiled (least recently used out first)."""

    compile_timeout_s: float = 30.0
    cache_size: int = 256

    def __post_init__(self) -> None:
        _need(self.compile_timeout_s > 0, f"grammar compile timeout must be > 0 s, got {self.compile_timeout_s}")
        _need(self.cache_size >= 1, f"grammar cache size must be >= 1, got {self.cache_size}")


SPECULATIVE_METHODS = ("ngram", "draft_model")


@dataclass
class SpeculativeConfig:
    """`--speculative-config` (vLLM's JSON keys): who proposes tokens and how many the target verifies per step.

    `ngram` looks the request's newest `prompt_lookup_max`..`prompt_lookup_min` tokens up in its own prompt and
    output; `draft_model` runs `model` (same tokenizer; `quantization` gguf of the target's own GGUF is a
    self-draft) in this process with its own KV cache. `num_speculative_tokens` "auto": the tuner picks k per
    step. No speculation once more than `disable_by_batch_size` requests run (None: never off for size).
    """

    method: str = "ngram"
    num_speculative_tokens: int | str = 3
    prompt_lookup_max: int = 3
    prompt_lookup_min: int = 1
    model: str | None = None
    quantization: str | None = None
    disable_by_batch_size: int | None = None

    def __post_init__(self) -> None:
        _need(self.method in SPECULATIVE_METHODS,
              f"speculative_config method must be one of {', '.join(SPECULATIVE_METHODS)}; got {self.method!r}")
        k = self.num_speculative_tokens
        _need(k == "auto" or (isinstance(k, int) and not isinstance(k, bool) and k >= 1),
              f"num_speculative_tokens must be an integer >= 1 or \"auto\", got {k!r}")
        _need(1 <= self.prompt_lookup_min <= self.prompt_lookup_max,
              f"speculative_config needs 1 <= prompt_lookup_min <= prompt_lookup_max, got "
              f"{self.prompt_lookup_min} and {self.prompt_lookup_max}")
        _need(self.method != "draft_model" or self.model, "speculative_config method draft_model needs a model")
        _need(self.method == "draft_model" or self.model is None,
              f"speculative_config model is for method draft_model, not {self.method!r}")
        _need(self.quantization is None or self.quantization in QUANTIZATIONS,
              f"speculative_config quantization must be one of {', '.join(QUANTIZATIONS)}; got {self.quantization!r}")
        _need(self.disable_by_batch_size is None or self.disable_by_batch_size >= 1,
              f"disable_by_batch_size must be >= 1, got {self.disable_by_batch_size}")

    @classmethod
    def parse(cls, value: "SpeculativeConfig | dict | str | None") -> "SpeculativeConfig | None":
        """From `LLM(speculative_config={...})`, the JSON of `--speculative-config`, or an instance; None: none."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            import json

            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"--speculative-config must be a JSON object: {e}") from None
        _need(isinstance(value, dict), f"speculative_config must be a JSON object, got {type(value).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        _need(not unknown, f"unknown speculative_config key(s): {', '.join(unknown)} (known: {', '.join(sorted(known))})")
        return cls(**value)

    def to_json(self) -> str:
        import json

        return json.dumps({f.name: getattr(self, f.name) for f in fields(self)
                           if getattr(self, f.name) != f.default or f.name == "method"})


@dataclass
class LoRAConfig:
    """Multi-LoRA serving: `max_loras` adapters in one batch (device slots), ranks up to `max_lora_rank`,
    `max_cpu_loras` adapters kept in host memory (None: max_loras)."""

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None

    def __post_init__(self) -> None:
        _need(self.max_loras >= 1, f"max_loras must be >= 1, got {self.max_loras}")
        _need(self.max_lora_rank >= 1, f"max_lora_rank must be >= 1, got {self.max_lora_rank}")
        if self.max_cpu_loras is None:
            self.max_cpu_loras = self.max_loras
        _need(self.max_cpu_loras >= self.max_loras,
              f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})")


@dataclass
class EngineConfig:
    """Everything `LLM(...)` / `ecoserve serve` accept."""

    model: str | None = None  # local dir, hub id or .gguf path; None: the embedded default
    tokenizer: str | None = None
    dtype: str = "auto"  # auto (see model.loader.resolve_dtype) | float32 | bfloat16 | float16
    quantization: str | None = None  # None/none: float weights | gguf: keep GGUF blocks | int8: Q8_0 weights | w8a8 (CPU)
    quantize_lm_head: bool = False  # w8a8: the LM head int8 too (else it stays float, as in vLLM's W8A8)
    cpu_linear: str = "auto"  # linears on CPU: auto | torch (F.linear) | onednn (prepacked oneDNN weights)
    device: str = "cpu"
    seed: int = 0
    num_threads: int | None = None  # torch intra-op threads on CPU
    revision: str | None = None
    skip_tokenizer_init: bool = False  # token-id prompts and outputs only: no tokenizer is loaded
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    structured_outputs: StructuredOutputsConfig = field(default_factory=StructuredOutputsConfig)
    speculative: SpeculativeConfig | None = None
    moe_resident_experts: int | None = None  # MoE: experts per layer on the device, the rest in host memory
    lora: LoRAConfig | None = None  # None: LoRA adapters off (--enable-lora turns them on)

    def __post_init__(self) -> None:
        _need(self.moe_resident_experts is None or self.moe_resident_experts >= 0,
              f"moe_resident_experts must be >= 0, got {self.moe_resident_experts}")
        _need(self.dtype in DTYPES, f"dtype must be one of {', '.join(DTYPES)}; got {self.dtype!r}")
        _need(self.cpu_linear in CPU_LINEARS, f"cpu_linear must be one of {', '.join(CPU_LINEARS)}; "
                                              f"got {self.cpu_linear!r}")
        _need(self.quantization is None or self.quantization in QUANTIZATIONS,
              f"quantization must be one of {', '.join(QUANTIZATIONS)}; got {self.quantization!r}")
        check_quantize_lm_head(self.quantization, self.quantize_lm_head)


@dataclass(frozen=True)
class Flag:
    """How an `EngineArgs` field is written on the command line (a bool field: a switch away from its default)."""

    names: tuple[str, ...]
    help: str
    type: Callable[[str], Any] = str
    choices: tuple[str, ...] | None = None


def _option(default: Any, *names: str, help: str, type: Callable[[str], Any] = str,
            choices: tuple[str, ...] | None = None) -> Any:
    return field(default=default, metadata={"flag": Flag(names, help, type, choices)})


def _layer_counts_flag(text: str) -> tuple[int, ...]:
    try:
        return parse_layer_counts(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


_SCHED, _CACHE, _PAR = SchedulerConfig, CacheConfig, ParallelConfig  # the defaults live in the typed configs
_STRUCT = StructuredOutputsConfig
_LORA = LoRAConfig


@dataclass
class EngineArgs:
    """Every engine option, flat, with vLLM's names: `LLM(model, **kwargs)`, the flags of the commands
    that build an engine and the flags that start a cluster instance are all these fields."""

    model: str | None = _option(
        EngineConfig.model, "--model", help="HF dir, hub id or .gguf (default: embedded SmolLM2-135M-Instruct)")
    tokenizer: str | None = _option(
        EngineConfig.tokenizer, "--tokenizer", help="HF tokenizer dir or hub id (default: the model's own)")
    revision: str | None = _option(EngineConfig.revision, "--revision", help="the hub revision of --model")
    skip_tokenizer_init: bool = _option(
        EngineConfig.skip_tokenizer_init, "--skip-tokenizer-init",
        help="load no tokenizer: prompts and outputs are token ids only")
    dtype: str = _option(EngineConfig.dtype, "--dtype", choices=DTYPES,
                         help="weights and activations; auto: bfloat16 on a CPU with bf16 instructions (AVX512-BF16 or "
                              "AMX) when the checkpoint is bfloat16 or float16 and unquantized or w8a8, else float32; "
                              "on GPUs the checkpoint's half dtype")
    quantization: str | None = _option(
        EngineConfig.quantization, "--quantization", choices=QUANTIZATIONS,
        help="quantization on CPU, opt-in (default none: float weights); gguf: a .gguf model keeps its "
             "Q4_0/Q4_1/Q8_0 blocks; int8: Q8_0 weights for HF checkpoints (small batches, decode); w8a8: int8 "
             "weights and per-token int8 activations through an int8 GEMM, oneDNN's with VNNI or AMX-INT8, else an "
             "exact native one (large batches; the LM head stays float unless --quantize-lm-head; float32 or "
             "bfloat16 around it, the others float32 only)")
    quantize_lm_head: bool = _option(
        EngineConfig.quantize_lm_head, "--quantize-lm-head",
        help="under --quantization w8a8, quantize the LM head too (default: it stays float, as vLLM's W8A8 keeps it)")
    cpu_linear: str = _option(
        EngineConfig.cpu_linear, "--cpu-linear", choices=CPU_LINEARS,
        help="float32 and bfloat16 linear layers on CPU: oneDNN with prepacked weights (onednn), torch's F.linear "
             "(torch), or auto (default): onednn where torch has it and one process holds the model (bfloat16 layers "
             "where oneDNN has bf16 support)")
    device: str = _option(EngineConfig.device, "--device", help="the torch device the model runs on")
    seed: int = _option(EngineConfig.seed, "--seed", type=int, help="seed of the sampler's random numbers")
    num_threads: int | None = _option(EngineConfig.num_threads, "--num-threads", type=int,
                                      help="torch intra-op threads on CPU, per rank (default: torch's)")
    scheduling_policy: str = _option(
        _SCHED.policy, "--scheduling-policy",
        help="which requests get tokens each step: a policy of ecoserve.sched.policies (chunked, prefill_first, "
             "temporal, tdpipe; default chunked)")
    max_num_batched_tokens: int = _option(_SCHED.max_num_batched_tokens, "--max-num-batched-tokens", type=int,
                                          help="tokens per engine step")
    max_num_seqs: int = _option(_SCHED.max_num_seqs, "--max-num-seqs", type=int, help="requests per engine step")
    max_model_len: int | None = _option(_SCHED.max_model_len, "--max-model-len", type=int,
                                        help="prompt plus output tokens per request (default: the model's)")
    max_waiting: int | None = _option(
        _SCHED.max_waiting, "--max-waiting-requests", type=int,
        help="refuse new requests with 503 + Retry-After while this many wait (default: unbounded)")
    grammar_compile_timeout_s: float = _option(
        _STRUCT.compile_timeout_s, "--grammar-compile-timeout", type=float,
        help="seconds a structured-output request waits for its grammar to compile before it fails (alone)")
    grammar_cache_size: int = _option(_STRUCT.cache_size, "--grammar-cache-size", type=int,
                                      help="compiled structured-output grammars kept (least recently used out first)")
    block_size: int = _option(_CACHE.block_size, "--block-size", type=int, help="tokens per KV block")
    kv_cache_memory_bytes: int | None = _option(
        _CACHE.kv_cache_memory_bytes, "--kv-cache-memory-bytes", type=int,
        help="KV cache budget (default on CPU: 1 GiB, or less when max-num-seqs requests at max-model-len need less)")
    num_gpu_blocks: int | None = _option(_CACHE.num_gpu_blocks, "--num-gpu-blocks", type=int,
                                         help="KV blocks (overrides the byte budget)")
    enable_prefix_caching: bool = _option(_CACHE.enable_prefix_caching, "--no-enable-prefix-caching",
                                          help="do not share the KV blocks of common prompt prefixes")
    kv_cache_dtype: str = _option(_CACHE.cache_dtype, "--kv-cache-dtype", choices=KV_CACHE_DTYPES,
                                  help="KV cache element type; auto (default): the model's dtype (a bfloat16 cache "
                                       "halves KV memory and the bytes decode attention reads)")
    tensor_parallel_size: int = _option(_PAR.tensor_parallel_size, "--tensor-parallel-size", "-tp", type=int,
                                        help="ranks per pipeline stage")
    pipeline_parallel_size: int = _option(_PAR.pipeline_parallel_size, "--pipeline-parallel-size", "-pp", type=int,
                                          help="pipeline stages")
    pp_layer_partition: tuple[int, ...] | None = _option(
        _PAR.pp_layer_partition, "--pp-layer-partition", type=_layer_counts_flag,
        help="layers per stage, e.g. 12,11 (default: floor(L/pp) each, the remainder to the stages before the "
             "last, which also runs the LM head)")
    max_concurrent_batches: int | None = _option(_PAR.max_concurrent_batches, "--max-concurrent-batches", type=int,
                                                 help="batches in flight (default: the pipeline parallel size)")
    step_timeout_s: float = _option(_PAR.step_timeout_s, "--step-timeout", type=float,
                                    help="seconds a parallel step may take before the stuck rank is named")
    startup_timeout_s: float = _option(_PAR.startup_timeout_s, "--startup-timeout", type=float,
                                       help="seconds the ranks of a parallel instance may take to load their shards")
    enable_expert_parallel: bool = _option(
        _PAR.enable_expert_parallel, "--enable-expert-parallel",
        help="mixture-of-experts layers: the tensor-parallel ranks hold whole experts (experts / tp each) instead of "
             "a slice of every expert; attention stays tensor parallel")
    moe_resident_experts: int | None = _option(
        EngineConfig.moe_resident_experts, "--moe-resident-experts", type=int,
        help="mixture-of-experts models: experts per layer kept on the device; the rest stay in host memory, "
             "computed there or moved on demand as the placement policy decides (default: all on the device)")

    # JSON; LLM(speculative_config={...}) and SpeculativeConfig instances are kept as their JSON (see __post_init__)
    speculative_config: str | None = _option(
        None, "--speculative-config", type=str,
        help='speculative decoding, as JSON with vLLM\'s keys, e.g. {"method": "ngram", "num_speculative_tokens": 3, '
             '"prompt_lookup_max": 3} or {"method": "draft_model", "model": "DRAFT", "num_speculative_tokens": 4, '
             '"quantization": "gguf"}; num_speculative_tokens "auto" lets the tuner pick (default: none)')

    def __post_init__(self) -> None:
        if isinstance(self.speculative_config, (dict, SpeculativeConfig)):
            self.speculative_config = SpeculativeConfig.parse(self.speculative_config).to_json()

    enable_lora: bool = _option(False, "--enable-lora", help="serve LoRA adapters on top of the model")
    max_loras: int = _option(_LORA.max_loras, "--max-loras", type=int, help="LoRA adapters in one batch")
    max_lora_rank: int = _option(_LORA.max_lora_rank, "--max-lora-rank", type=int,
                                 help="the highest LoRA rank accepted")
    max_cpu_loras: int | None = _option(_LORA.max_cpu_loras, "--max-cpu-loras", type=int,
                                        help="LoRA adapters cached in host memory (default: --max-loras)")

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser, skip: Collection[str] = ()) -> None:
        """Add a flag for each field; a command that gives one its own meaning lists it in `skip`."""
        for f in fields(cls):
            if f.name in skip:
                continue
            flag: Flag = f.metadata["flag"]
            if isinstance(f.default, bool):
                parser.add_argument(*flag.names, dest=f.name, action="store_false" if f.default else "store_true",
                                    help=flag.help)
                continue
            shown = flag.help if f.default is None or "default" in flag.help else f"{flag.help} (default: %(default)s)"
            metavar = None if flag.choices else flag.names[0].lstrip("-").upper().replace("-", "_")
            parser.add_argument(*flag.names, dest=f.name, type=flag.type, default=f.default, choices=flag.choices,
                                help=shown, metavar=metavar)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        """The options of a namespace parsed with `add_cli_args`; fields it has no value for keep their defaults."""
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)})

    @classmethod
    def from_kwargs(cls, model: str | None = None, **kwargs: Any) -> EngineArgs:
        """`LLM(model, **kwargs)`'s arguments; an unknown name is an error that says so."""
        unknown = sorted(set(kwargs) - {f.name for f in fields(cls)})
        if unknown:
            raise ValueError(f"unknown engine option(s): {', '.join(unknown)} (the options are the fields of "
                             f"ecoserve.config.EngineArgs)")
        return cls(model, **kwargs)

    @classmethod
    def flags(cls, **values: Any) -> list[str]:
        """These options as flags, whatever their defaults (a later flag on a command line overrides an earlier one)."""
        by_name = {f.name: f for f in fields(cls)}
        out: list[str] = []
        for name, value in values.items():
            if name not in by_name:
                raise ValueError(f"unknown engine option {name!r}")
            f = by_name[name]
            flag = f.metadata["flag"].names[0]
            if isinstance(f.default, bool):
                if value == f.default:
                    raise ValueError(f"{flag} only sets {name} to {not f.default}, not {value!r}")
                out.append(flag)
            elif value is None:
                raise ValueError(f"{flag} cannot set {name} to None (its default is {f.default!r})")
            elif isinstance(value, (tuple, list)):
                out += [flag, ",".join(str(v) for v in value)]
            else:
                out += [flag, str(value)]
        return out

    def to_cli_args(self) -> list[str]:
        """The flags that give a fresh process (`ecoserve instance`, a benchmark's child) these options: each one
        that is not its default."""
        return self.flags(**{f.name: getattr(self, f.name) for f in fields(self)
                             if getattr(self, f.name) != f.default})

    def create_engine_config(self) -> EngineConfig:
        """The typed, validated configuration `LLMEngine` runs."""
        return EngineConfig(
            model=self.model, tokenizer=self.tokenizer, revision=self.revision,
            skip_tokenizer_init=self.skip_tokenizer_init, dtype=self.dtype, quantization=self.quantization,
            quantize_lm_head=self.quantize_lm_head, cpu_linear=self.cpu_linear, device=self.device, seed=self.seed,
            num_threads=self.num_threads,
            scheduler=SchedulerConfig(policy=self.scheduling_policy, max_num_batched_tokens=self.max_num_batched_tokens,
                                      max_num_seqs=self.max_num_seqs, max_model_len=self.max_model_len,
                                      max_waiting=self.max_waiting),
            cache=CacheConfig(block_size=self.block_size, kv_cache_memory_bytes=self.kv_cache_memory_bytes,
                              num_gpu_blocks=self.num_gpu_blocks, enable_prefix_caching=self.enable_prefix_caching,
                              cache_dtype=self.kv_cache_dtype),
            parallel=ParallelConfig(tensor_parallel_size=self.tensor_parallel_size,
                                    pipeline_parallel_size=self.pipeline_parallel_size,
                                    pp_layer_partition=self.pp_layer_partition,
                                    max_concurrent_batches=self.max_concurrent_batches,
                                    step_timeout_s=self.step_timeout_s, startup_timeout_s=self.startup_timeout_s,
                                    enable_expert_parallel=self.enable_expert_parallel),
            structured_outputs=StructuredOutputsConfig(compile_timeout_s=self.grammar_compile_timeout_s,
                                                       cache_size=self.grammar_cache_size),
            speculative=SpeculativeConfig.parse(self.speculative_config),
            moe_resident_experts=self.moe_resident_experts,
            lora=LoRAConfig(max_loras=self.max_loras, max_lora_rank=self.max_lora_rank,
                            max_cpu_loras=self.max_cpu_loras) if self.enable_lora else None)
