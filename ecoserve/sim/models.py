"""Model catalogue: sizes, FLOPs and KV bytes from Hugging Face-style config fields.

The entries below restate the public `config.json` fields of each model (decoder-only, SwiGLU MLP or
mixture of SwiGLU experts, RMSNorm); any other local `config.json` of these families loads with
`from_hf_config`. A mixture-of-experts spec counts all experts in its total parameters (memory) and
`num_experts_per_tok` of them in its active parameters (FLOPs per token).
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
    # mixture of experts (0: a dense MLP of intermediate_size)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0  # one expert's intermediate size
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's always-on shared expert (0: none)
    explicit_head_dim: int = 0  # config's head_dim where it is not hidden_size / num_heads (Qwen3)

    @property
    def head_dim(self) -> int:
        return self.explicit_head_dim or self.hidden_size // self.num_heads

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def expert_params(self) -> int:
        """One routed expert's parameters (gate, up and down projections)."""
        return 3 * self.hidden_size * self.moe_intermediate_size

    @property
    def expert_bytes(self) -> float:
        return self.expert_params * self.dtype_bytes

    @property
    def dense_params_per_layer(self) -> int:
        """A layer's parameters outside the routed experts: attention, norms, and the dense MLP or the
        router and shared expert."""
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        attn = h * (q + 2 * kv) + q * h + ((q + 2 * kv) if self.qkv_bias else 0)
        if not self.is_moe:
            return attn + 3 * h * self.intermediate_size + 2 * h
        shared = 3 * h * self.shared_expert_intermediate_size + (h if self.shared_expert_intermediate_size else 0)
        return attn + h * self.num_experts + shared + 2 * h

    @property
    def params_per_layer(self) -> int:
        """All of a layer's parameters (every expert): what memory holds."""
        return self.dense_params_per_layer + self.num_experts * self.expert_params

    @property
    def active_params_per_layer(self) -> int:
        """The parameters one token uses in a layer: what its FLOPs follow."""
        return self.dense_params_per_layer + self.num_experts_per_tok * self.expert_params

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
        """2 x (active layer weights): the matmul FLOPs of one token through all layers (LM head excluded)."""
        return 2.0 * self.num_layers * self.active_params_per_layer

    def experts_touched(self, num_tokens: float) -> float:
        """Expected distinct experts a layer runs for a batch of `num_tokens` under uniform routing."""
        if not self.is_moe or num_tokens <= 0:
            return 0.0
        e = self.num_experts
        return e * (1.0 - (1.0 - self.num_experts_per_tok / e) ** num_tokens)

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
        **_moe_fields(cfg, heads),
    )


def _moe_fields(cfg: dict, heads: int) -> dict:
    """The expert fields of a Mixtral (`num_local_experts`) or Qwen2/3-MoE (`num_experts`) config."""
    extra = {}
    if cfg.get("head_dim") and cfg["head_dim"] != cfg["hidden_size"] // heads:
        extra["explicit_head_dim"] = cfg["head_dim"]
    experts = cfg.get("num_local_experts") or cfg.get("num_experts") or 0
    if not experts:
        return extra
    return {**extra, "num_experts": experts, "num_experts_per_tok": cfg["num_experts_per_tok"],
            "moe_intermediate_size": cfg.get("moe_intermediate_size") or cfg["intermediate_size"],
            "shared_expert_intermediate_size": cfg.get("shared_expert_intermediate_size") or 0}


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
# mixtures of experts (public config.json fields)
MODELS.add("mixtral-8x7b", ModelSpec("mixtral-8x7b", 4096, 32, 32, 8, 14336, 32000, max_model_len=32768,
                                     num_experts=8, num_experts_per_tok=2, moe_intermediate_size=14336))
MODELS.add("qwen3-30b-a3b", ModelSpec("qwen3-30b-a3b", 2048, 48, 32, 4, 6144, 151936, max_model_len=40960,
                                      num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
                                      explicit_head_dim=128))


def model(name_or_path: str) -> ModelSpec:
    """A catalogue entry by name, or a local directory / config.json path."""
    if name_or_path in MODELS:
        return MODELS.get(name_or_path)
    p = Path(name_or_path)
    if p.exists():
        return load_config(p)
    return MODELS.get(name_or_path)  # raises with the list of names
