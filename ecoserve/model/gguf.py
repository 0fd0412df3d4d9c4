"""GGUF (llama.cpp) -> HF-format directory: config from metadata, dequantized weights, tokenizer.

Weights are dequantized to float32 (exact for every GGUF quant type), renamed from llama.cpp
names to HF names, and llama.cpp's q/k row permutation (for its interleaved rotary) undone.
Conversions are cached by file name, size and mtime; see `cached_conversion`. With quantized
weights (`--quantization gguf`) config and tokenizer still come from the conversion, but the
weights are read from the GGUF file as stored blocks (`gguf_weight_types`, `indexed_gguf`).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ecoserve.cache_dir import cache_root
from ecoserve.model.spec import ModelLoadError, supported_list

_ARCHS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
          "qwen2moe": "Qwen2MoeForCausalLM", "qwen3moe": "Qwen3MoeForCausalLM"}
_MODEL_TYPES = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe"}  # llama.cpp's arch -> transformers' model_type
_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                 "output.weight": "lm_head.weight"}
_BLOCK_NAMES = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
                "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
                "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                "ffn_down": "mlp.down_proj",
                # mixture of experts: the router, all experts stacked [E, rows, cols], Qwen2-MoE's shared expert
                "ffn_gate_inp": "mlp.gate", "ffn_gate_exps": "mlp.experts.gate_proj",
                "ffn_up_exps": "mlp.experts.up_proj", "ffn_down_exps": "mlp.experts.down_proj",
                "ffn_gate_inp_shexp": "mlp.shared_expert_gate", "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
                "ffn_up_shexp": "mlp.shared_expert.up_proj", "ffn_down_shexp": "mlp.shared_expert.down_proj"}
_STACKED_EXPERTS = re.compile(r"(.*\.mlp\.experts)\.(\w+_proj\.weight)$")  # split into one HF tensor per expert
_MOE_MODULES = re.compile(r"\.mlp\.(gate|experts|shared_expert|shared_expert_gate)\.")  # kept float: see gguf_weight_types
_BLOCK = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")


def hf_tensor_name(name: str) -> str | None:
    """llama.cpp tensor name -> HF name (None for tensors HF does not store, e.g. rope tables)."""
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    m = _BLOCK.match(name)
    if m and m.group(2) in _BLOCK_NAMES:
        return f"model.layers.{m.group(1)}.{_BLOCK_NAMES[m.group(2)]}.{m.group(3)}"
    return None


def _unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    # llama.cpp stores each head's rows as interleaved (even, odd) pairs; HF keeps the two halves apart
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _field(reader: Any, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def gguf_config(reader: Any) -> dict[str, Any]:
    """A HF config.json dict from GGUF metadata."""
    arch = _field(reader, "general.architecture")
    if arch not in _ARCHS:
        raise ModelLoadError(f"unsupported GGUF architecture {arch!r}; supported: {', '.join(_ARCHS)} "
                             f"(HF: {supported_list()})")
    names = {t.name for t in reader.tensors}
    heads = int(_field(reader, f"{arch}.attention.head_count"))
    hidden = int(_field(reader, f"{arch}.embedding_length"))
    head_dim = int(_field(reader, f"{arch}.attention.key_length", hidden // heads))
    vocab = _field(reader, f"{arch}.vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
    config: dict[str, Any] = {
        "architectures": [_ARCHS[arch]], "model_type": arch, "hidden_size": hidden,
        "num_hidden_layers": int(_field(reader, f"{arch}.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_field(reader, f"{arch}.attention.head_count_kv", heads)),
        "head_dim": head_dim, "intermediate_size": int(_field(reader, f"{arch}.feed_forward_length")),
        "vocab_size": int(vocab), "hidden_act": "silu",
        "rms_norm_eps": float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        "max_position_embeddings": int(_field(reader, f"{arch}.context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": arch == "llama" and "blk.0.attn_q.bias" in names,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "dtype": "float32",
    }
    config.update(_moe_config(reader, arch, names))
    rope: dict[str, Any] = {"rope_theta": float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
                            "rope_type": "default"}
    scaling = _field(reader, f"{arch}.rope.scaling.type")
    if scaling == "linear":
        rope.update(rope_type="linear", factor=float(_field(reader, f"{arch}.rope.scaling.factor")))
    elif scaling not in (None, "none"):
        raise ModelLoadError(f"unsupported GGUF rope scaling {scaling!r}; supported: linear")
    if "rope_freqs.weight" in names:  # llama 3.1 stores its rope factors as a tensor
        raise ModelLoadError("GGUF files with rope_freqs (Llama 3.1 rope scaling) are not supported yet")
    config["rope_parameters"] = rope
    return config


def _moe_config(reader: Any, arch: str, names: set[str]) -> dict[str, Any]:
    """The config keys of a mixture-of-experts GGUF (llama.cpp stores Mixtral as arch llama with experts)."""
    experts = int(_field(reader, f"{arch}.expert_count", 0) or 0)
    if arch in _MODEL_TYPES:
        config: dict[str, Any] = {"model_type": _MODEL_TYPES[arch], "num_experts": experts,
                                  "moe_intermediate_size": int(_field(reader, f"{arch}.expert_feed_forward_length")),
                                  "num_experts_per_tok": int(_field(reader, f"{arch}.expert_used_count")),
                                  # llama.cpp renormalises Qwen3-MoE's top-k weights, not Qwen2-MoE's
                                  "norm_topk_prob": bool(_field(reader, f"{arch}.expert_weights_norm",
                                                                arch == "qwen3moe"))}
        if arch == "qwen2moe":
            config["shared_expert_intermediate_size"] = int(
                _field(reader, f"{arch}.expert_shared_feed_forward_length"))
            config["qkv_bias"] = "blk.0.attn_q.bias" in names
        else:
            config["attention_bias"] = "blk.0.attn_q.bias" in names
        return config
    if experts == 0:
        return {}
    if arch != "llama" or "blk.0.ffn_gate_exps.weight" not in names:
        raise ModelLoadError(f"unsupported GGUF mixture of experts (arch {arch!r}); supported: Mixtral (arch llama with "
                             f"ffn_*_exps tensors), qwen2moe, qwen3moe")
    return {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "num_local_experts": experts,
            "num_experts_per_tok": int(_field(reader, f"{arch}.expert_used_count"))}


def gguf_weight_types(reader: Any, config: dict[str, Any]) -> dict[str, int]:
    """Model module name -> GGML type, for the modules whose GGUF tensors can stay quantized.

    A fused module (qkv_proj, gate_up_proj) qualifies when all its tensors share one supported type;
    a tied lm_head follows the embedding.
    """
    from ecoserve.model.quant import QUANT_TYPES, module_of

    per_module: dict[str, set[int]] = {}
    for t in reader.tensors:
        name = hf_tensor_name(t.name)
        if name is not None and name.endswith(".weight") and not name.endswith("norm.weight") \
                and not _MOE_MODULES.search(name):  # MoE blocks hold stacked expert weights, not Linear modules
            per_module.setdefault(module_of(name), set()).add(int(t.tensor_type))
    types = {m: ts.pop() for m, ts in per_module.items() if len(ts) == 1 and next(iter(ts)) in QUANT_TYPES}
    if config["tie_word_embeddings"] and "embed_tokens" in types:
        types["lm_head"] = types["embed_tokens"]
    return types


def gguf_tensors(reader: Any, config: dict[str, Any],
                 keep_quantized: frozenset[str] = frozenset()) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) for every weight of the GGUF file: float32, or the stored uint8 blocks
    [rows, row_bytes] for tensors of the modules in `keep_quantized` (see `gguf_weight_types`)."""
    from gguf.quants import dequantize

    from ecoserve.model.quant import module_of

    permute = config["model_type"] in ("llama", "mixtral")
    for t in reader.tensors:
        name = hf_tensor_name(t.name)
        if name is None:
            continue
        if module_of(name) in keep_quantized and name.endswith(".weight"):
            w = t.data.reshape(int(t.shape[-1]), -1)  # blocks along each row; q/k rows permute like floats
        else:
            w = dequantize(t.data, t.tensor_type).reshape([int(d) for d in reversed(t.shape)])
        if permute and name.endswith(("q_proj.weight", "k_proj.weight", "q_proj.bias", "k_proj.bias")):
            key = "num_attention_heads" if ".q_proj." in name else "num_key_value_heads"
            w = _unpermute(w, config[key])
        stacked = _STACKED_EXPERTS.match(name)
        if stacked:
            for expert, rows in enumerate(w):
                yield f"{stacked.group(1)}.{expert}.{stacked.group(2)}", torch.from_numpy(
                    np.require(rows, np.float32, ["C", "W"]))
            continue
        yield name, torch.from_numpy(np.require(w, w.dtype if w.dtype == np.uint8 else np.float32, ["C", "W"]))


def read_gguf(gguf_path: str | Path) -> Any:
    from gguf import GGUFReader

    try:
        return GGUFReader(gguf_path)
    except Exception as e:
        raise ModelLoadError(f"could not read GGUF file {gguf_path}: {e}") from None


TENSOR_INDEX = "gguf_tensors.json"  # where each tensor lies in the GGUF file, beside the conversion


@dataclass(frozen=True)
class IndexedTensor:
    """The parts of gguf's ReaderTensor that loading uses, read from TENSOR_INDEX without parsing the
    file's metadata (GGUFReader spends seconds on the tokenizer arrays)."""

    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # GGUF order: innermost dimension first
    data: np.ndarray  # a read-only memmap of the stored bytes


@dataclass(frozen=True)
class IndexedGGUF:
    tensors: list[IndexedTensor]


def _write_tensor_index(reader: Any, out_dir: Path) -> None:
    index = [{"name": t.name, "type": int(t.tensor_type), "shape": [int(d) for d in t.shape],
              "offset": int(t.data_offset), "dtype": t.data.dtype.str, "data_shape": list(t.data.shape)}
             for t in reader.tensors]
    tmp = out_dir / f".{TENSOR_INDEX}.{os.getpid()}"
    tmp.write_text(json.dumps(index))
    os.replace(tmp, out_dir / TENSOR_INDEX)  # atomic: concurrent loaders read a whole index


def indexed_gguf(gguf_path: Path, converted: Path) -> IndexedGGUF:
    """The GGUF's tensors as memmaps, located by the tensor index kept beside the conversion
    (written on first use: GGUFReader parses the whole file once)."""
    from gguf import GGMLQuantizationType

    if not (converted / TENSOR_INDEX).is_file():
        _write_tensor_index(read_gguf(gguf_path), converted)
    tensors = [IndexedTensor(e["name"], GGMLQuantizationType(e["type"]), tuple(e["shape"]),
                             np.memmap(gguf_path, dtype=np.dtype(e["dtype"]), mode="r", offset=e["offset"],
                                       shape=tuple(e["data_shape"])))
               for e in json.loads((converted / TENSOR_INDEX).read_text())]
    return IndexedGGUF(tensors)


def convert_gguf(gguf_path: str | Path, out_dir: str | Path) -> Path:
    """Write a HF-format directory (config, model.safetensors, tokenizer, generation_config) from a GGUF."""
    from safetensors.torch import save_file

    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    reader = read_gguf(gguf_path)
    config = gguf_config(reader)
    out_dir.mkdir(parents=True, exist_ok=True)
    _write_tensor_index(reader, out_dir)
    save_file(dict(gguf_tensors(reader, config)), out_dir / "model.safetensors", metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    generation = {k: config[k] for k in ("bos_token_id", "eos_token_id") if config[k] is not None}
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2))
    _convert_tokenizer(gguf_path, out_dir)
    return out_dir


def _convert_tokenizer(gguf_path: Path, out_dir: Path) -> None:
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    except Exception as e:
        raise ModelLoadError(f"could not build a tokenizer from GGUF file {gguf_path}: {e}") from None
    tok.save_pretrained(out_dir)


def cached_conversion(gguf_path: str | Path, generation_defaults: dict | None = None) -> Path:
    """The converted directory of `gguf_path`, converting on first use.

    Concurrent first uses each convert into a private temp dir and rename it into place; the
    first rename wins and the others discard their copy, so readers never see a partial dir.
    `generation_defaults` (e.g. a model card's recommended sampling) go into its
    generation_config.json, also in a directory converted before they were known.
    """
    gguf_path = Path(gguf_path).resolve()
    st = gguf_path.stat()
    target = cache_root() / "gguf" / f"{gguf_path.stem}-{st.st_size}-{st.st_mtime_ns}"
    if not (target / "config.json").is_file():
        _convert_into_place(gguf_path, target)
    if generation_defaults:
        _merge_generation_config(target, generation_defaults)
    return target


def _merge_generation_config(model_dir: Path, values: dict) -> None:
    path = model_dir / "generation_config.json"
    current = json.loads(path.read_text()) if path.is_file() else {}
    if all(current.get(k) == v for k, v in values.items()):
        return
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(json.dumps({**current, **values}, indent=2))
    os.replace(tmp, path)  # atomic: a concurrent reader sees the old file or the new one


def _convert_into_place(gguf_path: Path, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        convert_gguf(gguf_path, tmp)
        try:
            os.rename(tmp, target)
        except OSError:  # another process won the race
            if not (target / "config.json").is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)

