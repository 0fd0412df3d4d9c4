"""The Llama decoder family (Llama, Mistral, Qwen2, Qwen3) as plain PyTorch modules.

The model runs a *flattened* batch: the tokens of all sequences of a step are concatenated
(no batch dimension, no padding) and `positions` gives each token's position in its sequence.
Attention itself, and the KV cache, belong to the `AttentionBackend` passed to `forward`.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from ecoserve.model.attention import AttentionBackend
from ecoserve.model.layers import GatedMLP, RMSNorm
from ecoserve.model.rope import RotaryEmbedding, apply_rotary
from ecoserve.model.spec import ModelLoadError, ModelSpec


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec, layer_idx: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
        self.q_size, self.kv_size = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
        self.scale = spec.head_dim ** -0.5
        self.qkv_proj = nn.Linear(spec.hidden_size, self.q_size + 2 * self.kv_size, bias=spec.qkv_bias, dtype=dtype)
        self.o_proj = nn.Linear(self.q_size, spec.hidden_size, bias=spec.o_bias, dtype=dtype)
        # Qwen3 normalises each head of q and k before rotary
        self.q_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps, dtype) if spec.qk_norm else None
        self.k_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps, dtype) if spec.qk_norm else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionBackend) -> torch.Tensor:
        T = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(T, self.num_heads, self.head_dim)
        k = k.view(T, self.num_kv_heads, self.head_dim)
        v = v.view(T, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = attn(self.layer_idx, q, k, v, self.scale)
        return self.o_proj(out.reshape(T, self.q_size))


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, layer_idx: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype)
        self.self_attn = Attention(spec, layer_idx, dtype)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype)
        self.mlp = GatedMLP(spec.hidden_size, spec.intermediate_size, spec.mlp_bias, dtype)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionBackend) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, attn)
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaModel(nn.Module):
    """Decoder-only LM: `forward` gives final hidden states, `compute_logits` the float32 logits."""

    def __init__(self, spec: ModelSpec, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.spec = spec
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(DecoderLayer(spec, i, dtype) for i in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype)
        self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False, dtype=dtype)
        if spec.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary = RotaryEmbedding(spec.rope, spec.head_dim, spec.max_position_embeddings, dtype)

    # facts the engine sizes its KV cache with
    @property
    def num_layers(self) -> int:
        return self.spec.num_layers

    @property
    def num_kv_heads(self) -> int:
        return self.spec.num_kv_heads

    @property
    def head_dim(self) -> int:
        return self.spec.head_dim

    @property
    def dtype(self) -> torch.dtype:  # of activations and KV cache (quantized weights are uint8)
        return self.norm.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    def ensure_positions(self, num_positions: int) -> None:
        """Grow the rotary tables so positions [0, num_positions) are valid (default: max_position_embeddings)."""
        if num_positions > self.rotary.num_positions:
            self.rotary.build(num_positions, self.device)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend) -> torch.Tensor:
        """input_ids, positions: [T] -> final-norm hidden states [T, hidden_size]."""
        h = self.embed_tokens(input_ids)
        cos, sin = self.rotary(positions)
        for layer in self.layers:
            h = layer(h, cos, sin, attn)
        return self.norm(h)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden_size] -> float32 logits [N, vocab_size]."""
        return self.lm_head(hidden).float()

    # HF checkpoint names -> our fused parameters: (fused name, shard index)
    _FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
              "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors into our parameters (casting to our dtype); raise if any is missing."""
        params = dict(self.named_parameters())  # a tied lm_head appears once, as embed_tokens
        needed: set[tuple[str, int]] = set()
        for name in params:
            module = name.split(".")[-2]
            needed |= {(name, s) for f, s in self._FUSED.values() if f == module} or {(name, -1)}
        for hf_name, tensor in weights:
            name = hf_name.removeprefix("model.")
            if "rotary_emb" in name or (name == "lm_head.weight" and self.spec.tie_word_embeddings):
                continue
            shard = -1
            parts = name.split(".")
            if len(parts) >= 2 and parts[-2] in self._FUSED:
                fused, shard = self._FUSED[parts[-2]]
                name = ".".join(parts[:-2] + [fused, parts[-1]])
            if name not in params:
                raise ModelLoadError(f"checkpoint tensor {hf_name!r} does not belong to a {self.spec.architecture} "
                                     f"with this config.json")
            target = self._shard(params[name], name, shard)
            if tuple(target.shape) != tuple(tensor.shape):
                raise ModelLoadError(f"checkpoint tensor {hf_name!r} has shape {tuple(tensor.shape)}, "
                                     f"config.json implies {tuple(target.shape)}")
            with torch.no_grad():
                target.copy_(tensor)
            needed.discard((name, shard))
        if needed:
            missing = sorted(f"{n}[{s}]" if s >= 0 else n for n, s in needed)
            raise ModelLoadError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:5]}")

    def _shard(self, param: torch.Tensor, name: str, shard: int) -> torch.Tensor:
        if shard < 0:
            return param.data
        if ".qkv_proj." in name:
            q, kv = self.spec.num_heads * self.spec.head_dim, self.spec.num_kv_heads * self.spec.head_dim
            start, size = [(0, q), (q, kv), (q + kv, kv)][shard]
        else:
            size = self.spec.intermediate_size
            start = shard * size
        return param.data.narrow(0, start, size)
