"""Model catalogue: sizes, FLOPs and KV bytes from Hugging Face-style config fields.

The entries below restate the public `config.json` fields of each model (dense decoder-only,
SwiGLU MLP, RMSNorm); any other local `config.json` of that family loads with `from_hf_config`.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ecoserve.registry import Registry


@dataclass(frozen=True)
class ModelSpec:
    name: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    dtype_bytes: int = 2  # bf16
    max_model_len: int = 4096

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def params_per_layer(self) -> int:
        h, kv = self.hidden_size, self.num_kv_heads * self.head_dim
        attn = h * (h + 2 * kv) + h * h + ((h + 2 * kv) if self.qkv_bias else 0)
        mlp = 3 * h * self.intermediate_size
        return attn + mlp + 2 * h

    @property
    def num_params(self) -> int:
        embed = self.vocab_size * self.hidden_size
        head = 0 if self.tie_word_embeddings else embed
        return self.num_layers * self.params_per_layer + embed + head + self.hidden_size

    @property
    def weight_bytes(self) -> float:
        return self.num_params * self.dtype_bytes

    @property
    def streamed_weight_bytes(self) -> float:
        """Bytes read per forward pass: all weights except the input embedding (only rows are gathered)."""
        embed = 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size
        return (self.num_params - embed) * self.dtype_bytes

    @property
    def linear_flops_per_token(self) -> float:
        """2 x (layer weights): the matmul FLOPs of one token through all layers (LM head excluded)."""
        return 2.0 * self.num_layers * self.params_per_layer

    @property
    def lm_head_flops(self) -> float:
        """FLOPs of the LM head for one sampled position."""
        return 2.0 * self.vocab_size * self.hidden_size

    def attention_flops(self, num_new: int, start: int) -> float:
        """QK^T and AV FLOPs for `num_new` causal queries after `start` cached tokens, all layers."""
        pairs = num_new * start + num_new * (num_new + 1) / 2
        return 4.0 * self.num_layers * self.num_heads * self.head_dim * pairs

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes

    def flops_per_token(self, context_len: int) -> float:
        """FLOPs to decode one token attending to `context_len` tokens (LM head included)."""
        return self.linear_flops_per_token + self.lm_head_flops + self.attention_flops(1, context_len - 1)


def from_hf_config(cfg: dict, name: str | None = None) -> ModelSpec:
    """Build a spec from a parsed HF `config.json` dict (Llama / Mistral / Qwen2 field names)."""
    heads = cfg["num_attention_heads"]
    arch = " ".join(cfg.get("architectures") or [])
    return ModelSpec(
        name=name or cfg.get("_name_or_path") or arch or "model",
        hidden_size=cfg["hidden_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        intermediate_size=cfg["intermediate_size"],
        vocab_size=cfg["vocab_size"],
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=bool(cfg.get("attention_bias", False)) or cfg.get("model_type") == "qwen2",
        max_model_len=cfg.get("max_position_embeddings", 4096),
    )


def load_config(path: str | Path, name: str | None = None) -> ModelSpec:
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    return from_hf_config(json.loads(p.read_text()), name or p.parent.name)


MODELS: Registry[ModelSpec] = Registry("model")


def _llama(name, h, layers, heads, kv, inter, vocab=32000, max_len=4096, qwen=False) -> None:
    MODELS.add(name, ModelSpec(name, h, layers, heads, kv, inter, vocab, qkv_bias=qwen, max_model_len=max_len))


_llama("llama-30b", 6656, 60, 52, 52, 17920, max_len=2048)  # LLaMA-1 "30B" (33B), MHA
_llama("codellama-34b", 8192, 48, 64, 8, 22016, max_len=16384)
_llama("qwen2-72b", 8192, 80, 64, 8, 29568, vocab=152064, max_len=32768, qwen=True)
_llama("llama-2-13b", 5120, 40, 40, 40, 13824, max_len=4096)
_llama("qwen2.5-32b", 5120, 64, 40, 8, 27648, vocab=152064, max_len=32768, qwen=True)
_llama("llama-3-8b", 4096, 32, 32, 8, 14336, vocab=128256, max_len=8192)
_llama("llama-3-70b", 8192, 80, 64, 8, 28672, vocab=128256, max_len=8192)


def model(name_or_path: str) -> ModelSpec:
    """A catalogue entry by name, or a local directory / config.json path."""
    if name_or_path in MODELS:
        return MODELS.get(name_or_path)
    p = Path(name_or_path)
    if p.exists():
        return load_config(p)
    return MODELS.get(name_or_path)  # raises with the list of names
