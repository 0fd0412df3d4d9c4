"""load_model: a local HF directory, a .gguf file, a hub id or the embedded default -> LoadedModel."""
from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ecoserve.config import QUANTIZATIONS, check_quantize_lm_head
from ecoserve.kernels import paths
from ecoserve.kernels.cpu import CpuCapabilities
from ecoserve.model.parallel import ShardPlan, StageLink, TPComm
from ecoserve.model.quant import describe_weights, quantize_linears_int8, quantize_model_modules, weight_bytes
from ecoserve.model.registry import get_model_class
from ecoserve.model.spec import ModelLoadError, ModelSpec

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_HUB_FILES = ["config.json", "generation_config.json", "*.safetensors", "model.safetensors.index.json",
              "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
              "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "chat_template.json"]
_GENERATION_KEYS = ("temperature", "top_p", "top_k", "repetition_penalty")


@dataclass
class LoadedModel:
    model: torch.nn.Module | None  # None from load_model_info (no weights)
    tokenizer: Any  # transformers.PreTrainedTokenizerFast
    spec: ModelSpec
    eos_token_ids: frozenset[int]
    generation_defaults: dict[str, Any] = field(default_factory=dict)
    max_model_len: int = 0
    name: str = ""  # what the user passed; the served model name
    path: Path = Path()
    quantization: str | None = None  # "gguf" | "int8" | "w8a8" | None (float weights)


_HALF_CHECKPOINTS = ("bfloat16", "float16")


def resolve_dtype(dtype: str | torch.dtype, device: str | torch.device = "cpu",
                  checkpoint_dtype: str | None = None, quantization: str | None = None,
                  caps: CpuCapabilities | None = None) -> torch.dtype:
    """The dtype of weights and activations. 'auto' follows vLLM's CPU backend: on a CPU with bf16
    instructions a bfloat16 or float16 checkpoint runs in bfloat16 (oneDNN/AMX GEMMs several times
    float32's), anything else in float32; so does `w8a8` (vLLM's CPU W8A8 runs bfloat16 activations),
    while the block-quantized weights (`int8`, `gguf`) always take float32 activations. On
    accelerators: the checkpoint's half dtype, else bfloat16. `caps`: the CPU's (tests describe others)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        if torch.device(device).type != "cpu":
            return torch.float16 if checkpoint_dtype == "float16" else torch.bfloat16
        if quantization in (None, "none", "w8a8") and checkpoint_dtype in _HALF_CHECKPOINTS and paths.bf16_is_fast(caps):
            return torch.bfloat16
        return torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of auto, {', '.join(_DTYPES)}; got {dtype!r}")
    return _DTYPES[dtype]


def warn_if_slow_bf16(dtype: torch.dtype, device: str | torch.device = "cpu",
                      caps: CpuCapabilities | None = None) -> bool:
    """Log one line when bfloat16 runs on a CPU without bf16 instructions (it works, converting in registers and
    running its linears on float32 GEMMs over widened weights: docs/architecture.md, "bfloat16 on CPU")."""
    if dtype != torch.bfloat16 or torch.device(device).type != "cpu" or paths.bf16_is_fast(caps):
        return False
    logger.warning("bfloat16 on a CPU without bf16 instructions (no AVX512-BF16 or AMX-BF16): its products are "
                   "widened to float32 (the linears' float32 GEMMs on widened weights where oneDNN has no bf16), at "
                   "float32's speed at best; --dtype float32 (or auto) is as fast or faster on this machine")
    return True


def resolve_model_path(model: str | None, revision: str | None = None) -> Path:
    """Local directory for `model`: converts GGUF files (cached), downloads hub ids (cached)."""
    if model is None:
        from ecoserve.model.default import default_model_dir
        return default_model_dir()
    local = Path(model).expanduser()
    if local.is_dir():
        return local
    if model.endswith(".gguf"):
        if not local.is_file():
            raise ModelLoadError(f"GGUF file {model} does not exist")
        from ecoserve.model.gguf import cached_conversion
        return cached_conversion(local)
    if local.exists():
        raise ModelLoadError(f"{model} is not a model directory or .gguf file")
    if model.startswith((".", "/", "~")):
        raise ModelLoadError(f"{model} does not exist (expected a model directory, a .gguf file or a hub id)")
    return _download(model, revision)


def _download(repo_id: str, revision: str | None) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (HFValidationError, LocalEntryNotFoundError, RepositoryNotFoundError,
                                        RevisionNotFoundError)

    try:
        return Path(snapshot_download(repo_id, revision=revision, allow_patterns=_HUB_FILES))
    except HFValidationError:
        raise ModelLoadError(f"{repo_id!r} is neither a local directory, a .gguf file, nor a valid "
                             f"Hugging Face hub id (org/name)") from None
    except LocalEntryNotFoundError:
        from huggingface_hub import constants

        offline = constants.HF_HUB_OFFLINE or os.environ.get("HF_HUB_OFFLINE", "0") not in ("", "0", "false")
        why = "HF_HUB_OFFLINE is set" if offline else "the hub could not be reached"
        raise ModelLoadError(f"model {repo_id!r} is not a local path and is not in the Hugging Face cache, and "
                             f"{why}; download it first (hf download {repo_id}) or pass a local "
                             f"directory") from None
    except (RepositoryNotFoundError, RevisionNotFoundError) as e:
        raise ModelLoadError(f"model {repo_id!r} (revision {revision or 'main'}) not found on the Hugging Face "
                             f"hub: {type(e).__name__}") from None


def safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ModelLoadError(f"malformed {index}: {e!r}") from None
        files = [path / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"{index} lists shards that are missing: {', '.join(missing)}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no *.safetensors weights in {path} (only safetensors checkpoints are supported; "
                             f"convert .bin weights with transformers' save_pretrained(safe_serialization=True))")
    return files


def iter_safetensors(files: list[Path]) -> Iterator[tuple[str, Any]]:
    """(name, lazy slice) per checkpoint tensor: the model reads only the rows or columns it holds."""
    from safetensors import safe_open

    for file in files:
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_slice(name)


def build_model(spec: ModelSpec, path: Path, dtype: torch.dtype, device: str | torch.device,
                shard: ShardPlan = ShardPlan(), tp: TPComm | None = None, link: StageLink | None = None,
                weights: Iterator[tuple[str, Any]] | None = None,
                quantized: dict[str, int] | None = None) -> torch.nn.Module:
    """Allocate the model (or one rank's shard of it) once in `dtype` on `device` and load the checkpoint.

    `weights` defaults to the safetensors under `path`; `quantized` names the modules that hold
    GGUF blocks instead (module name -> GGML type, see ecoserve.model.quant; single process only).
    """
    cls = get_model_class(spec.architecture)
    with torch.device("meta"):
        model = cls(spec, dtype, shard, tp, link)
        if quantized:
            quantize_model_modules(model, quantized)
    model = model.to_empty(device=device)
    model.tie_weights()  # to_empty re-creates parameters, so tie again
    model.rotary.build(spec.max_position_embeddings, device)
    model.load_weights(weights if weights is not None else iter_safetensors(safetensors_files(path)))
    return model.eval().requires_grad_(False)


def gguf_file(model: str | None) -> Path | None:
    """The .gguf file `model` names (None: the embedded default), or None for other models."""
    if model is None:
        from ecoserve.model.default import default_gguf_path
        return default_gguf_path()
    if not model.endswith(".gguf"):
        return None
    if not Path(model).expanduser().is_file():
        raise ModelLoadError(f"GGUF file {model} does not exist")
    return Path(model).expanduser()


def resolve_quantization(quantization: str | None, dtype: str | torch.dtype, is_gguf: bool, device: str) -> str | None:
    """None or 'none': float weights (the default); 'gguf' keeps a GGUF file's blocks; 'int8' makes Q8_0
    blocks of a float checkpoint (weight-only, for memory-bound decode); 'w8a8' makes per-channel int8
    weights and quantizes activations per token (int8 GEMMs, for compute-bound batches). Quantized
    weights run on CPU, with float32 activations, or bfloat16 ones for 'w8a8' (as vLLM's CPU W8A8 runs)."""
    if quantization in (None, "none"):
        return None
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}; got {quantization!r}")
    if quantization == "gguf" and not is_gguf:
        raise ValueError("--quantization gguf needs a .gguf model; use --quantization int8 or w8a8 for other checkpoints")
    allowed = ("auto", "float32", torch.float32) + (("bfloat16", torch.bfloat16) if quantization == "w8a8" else ())
    if dtype not in allowed or torch.device(device).type != "cpu":
        raise ValueError(f"quantized weights run on CPU with float32 activations (w8a8: or bfloat16); got dtype "
                         f"{dtype}, device {device}")
    return quantization


def _build_gguf_quantized(gguf_path: Path, spec: ModelSpec, converted: Path, device: str) -> torch.nn.Module:
    """Weights straight from the GGUF file's blocks (config and tokenizer came from its conversion)."""
    from ecoserve.model.gguf import gguf_tensors, gguf_weight_types, indexed_gguf

    reader = indexed_gguf(gguf_path, converted)
    types = gguf_weight_types(reader, spec.raw)
    weights = gguf_tensors(reader, spec.raw, keep_quantized=frozenset(types))
    return build_model(spec, converted, torch.float32, device, weights=weights, quantized=types)


def load_tokenizer(source: str | Path, revision: str | None = None):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(source), revision=revision)
    except Exception as e:  # transformers raises many kinds; the message is what matters
        raise ModelLoadError(f"could not load a tokenizer from {source}: {e}") from None


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"malformed {path}: {e}") from None
    return data if isinstance(data, dict) else {}


def _ids(value: Any) -> set[int]:
    if value is None:
        return set()
    return {int(v) for v in value} if isinstance(value, list) else {int(value)}


def load_model_info(model: str | None, *, revision: str | None = None, tokenizer: str | None = None,
                    skip_tokenizer_init: bool = False) -> LoadedModel:
    """Everything but the weights (`model` is None): what a cluster frontend needs to tokenize and validate."""
    path = resolve_model_path(model, revision)
    spec = ModelSpec.from_dir(path)
    tok = None if skip_tokenizer_init else load_tokenizer(tokenizer or path, revision if tokenizer else None)
    generation = _read_json(path / "generation_config.json")
    eos = set(spec.eos_token_ids) | _ids(generation.get("eos_token_id"))
    if tok is not None:
        eos |= _ids(tok.eos_token_id)
    defaults = {k: generation[k] for k in _GENERATION_KEYS if generation.get(k) is not None}
    if model is None:
        from ecoserve.model.default import DEFAULT_MODEL_NAME
        name = DEFAULT_MODEL_NAME
    else:
        name = model
    return LoadedModel(model=None, tokenizer=tok, spec=spec, eos_token_ids=frozenset(eos),
                       generation_defaults=defaults, max_model_len=spec.max_position_embeddings,
                       name=name, path=path)


def load_model(model: str | None, *, dtype: str | torch.dtype = "auto", device: str = "cpu",
               revision: str | None = None, tokenizer: str | None = None,
               skip_tokenizer_init: bool = False, weights: bool = True,
               quantization: str | None = None, cpu_linear: str = "auto",
               quantize_lm_head: bool = False) -> LoadedModel:
    """Load weights, tokenizer (unless skipped: then None) and serving facts.

    `model`: directory, .gguf, hub id, or None (embedded). weights=False: everything but the weights
    (`model` is None); parallel workers load their own shards. `quantization`: see `resolve_quantization`;
    `quantize_lm_head`: under w8a8 the LM head is int8 too (else it stays float, as vLLM's W8A8 keeps it).
    `cpu_linear="onednn"`: float32 and bfloat16 linear layers on CPU run prepacked oneDNN weights
    (model/packed.py); "auto" does so where torch has oneDNN (2x torch's float32 GEMM per core here,
    docs/benchmarks.md); bfloat16 layers where oneDNN supports bf16 on this CPU either way.
    """
    resolve_dtype(dtype)  # reject a bad name before any download or conversion
    source = gguf_file(model)
    quantization = resolve_quantization(quantization, dtype, source is not None, device)
    check_quantize_lm_head(quantization, quantize_lm_head)
    if (quantization is not None or cpu_linear == "onednn") and not weights:
        raise ValueError("--quantization and --cpu-linear onednn run in a single-process instance, not under TP/PP")
    info = load_model_info(model, revision=revision, tokenizer=tokenizer, skip_tokenizer_init=skip_tokenizer_init)
    info.quantization = quantization
    spec = info.spec
    if spec.sliding_window is not None and spec.sliding_window < spec.max_position_embeddings:
        logger.warning("%s uses sliding-window attention (%d tokens); ecoserve runs full attention, so outputs "
                       "differ from the reference past that length", spec.architecture, spec.sliding_window)
    if not weights:
        return info
    if quantization == "gguf":
        info.model = _build_gguf_quantized(source, spec, info.path, device)
    else:
        resolved = resolve_dtype(dtype, device, spec.torch_dtype, quantization)
        if not warn_if_slow_bf16(resolved, device) and dtype == "auto" and resolved == torch.float32 \
                and spec.torch_dtype in _HALF_CHECKPOINTS and torch.device(device).type == "cpu":
            logger.info("--dtype auto: float32 for this %s checkpoint, since this CPU has no bf16 dot products "
                        "(AVX512-BF16 or AMX-BF16); bfloat16 would only widen to float32 GEMMs",
                        spec.torch_dtype)
        info.model = build_model(spec, info.path, resolved, device)
        if quantization == "int8":
            quantize_linears_int8(info.model)
        elif quantization == "w8a8":
            from ecoserve.model.w8a8 import quantize_linears_w8a8

            quantize_linears_w8a8(info.model, lm_head=quantize_lm_head)
    from ecoserve.model.packed import onednn_available, pack_linears, pack_moe_experts

    if cpu_linear == "onednn" and not onednn_available():
        raise ValueError("--cpu-linear onednn: this torch build has no oneDNN (mkldnn) backend")
    if cpu_linear == "onednn" or (cpu_linear == "auto" and onednn_available()):
        pack_linears(info.model)  # float32 layers on CPU, and bfloat16 ones where oneDNN has bf16
        pack_moe_experts(info.model, float32=cpu_linear == "onednn")  # bf16 experts; float32 ones when named
    logger.info("model weights: %.1f MiB in memory (%s)", weight_bytes(info.model) / 2**20,
                describe_weights(info.model))
    return info
