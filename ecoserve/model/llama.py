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
from ecoserve.model.fused import native_for
from ecoserve.model.layers import GatedMLP, RMSNorm
from ecoserve.model.moe import SparseMoeBlock
from ecoserve.model.parallel import (Checkpointed, HeadShard, ParallelLMHead, RowParallelLinear, ShardPlan, StageLink,
                                     TPComm, VocabParallelEmbedding)
from ecoserve.model.parallel import take as _take
from ecoserve.model.rope import RotaryEmbedding, apply_rotary
from ecoserve.model.spec import ModelLoadError, ModelSpec


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec, layer_idx: int, dtype: torch.dtype, tp: TPComm | None = None) -> None:
        super().__init__()
        self.layer_idx = layer_idx  # within this rank's stage: the index into its KV cache
        heads = HeadShard.of(spec, tp.size if tp else 1, tp.rank if tp else 0)
        self.num_heads, self.num_kv_heads, self.head_dim = heads.num_heads, heads.num_kv_heads, spec.head_dim
        self.q_size, self.kv_size = heads.num_heads * spec.head_dim, heads.num_kv_heads * spec.head_dim
        self.scale = spec.head_dim ** -0.5
        self.qkv_proj = nn.Linear(spec.hidden_size, self.q_size + 2 * self.kv_size, bias=spec.qkv_bias, dtype=dtype)
        self.o_proj = RowParallelLinear(self.q_size, spec.hidden_size, spec.o_bias, dtype, tp)
        # Qwen3 normalises each head of q and k before rotary
        self.q_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps, dtype) if spec.qk_norm else None
        self.k_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps, dtype) if spec.qk_norm else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionBackend) -> torch.Tensor:
        T = x.shape[0]
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(T, self.num_heads, self.head_dim)
        k = k.view(T, self.num_kv_heads, self.head_dim)
        v = v.view(T, self.num_kv_heads, self.head_dim)
        norms_alike = self.q_norm is None or self.q_norm.weight.dtype == qkv.dtype
        native = native_for(qkv) if qkv.is_contiguous() and cos.dtype == qkv.dtype and norms_alike else None
        if native is not None:  # q and k side by side in each row: in-place passes normalise and rotate both
            if self.q_norm is not None:
                native.head_rms_norm_(q, self.q_norm.weight, self.q_norm.eps)
                native.head_rms_norm_(k, self.k_norm.weight, self.k_norm.eps)
            native.rotary_(qkv[:, :self.q_size + self.kv_size].view(T, -1, self.head_dim), cos, sin)
        else:
            if self.q_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = attn(self.layer_idx, q, k, v, self.scale)
        return self.o_proj(out.reshape(T, self.q_size))


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, layer_idx: int, dtype: torch.dtype, tp: TPComm | None = None,
                 global_idx: int | None = None, expert_parallel: bool = False) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype)
        self.self_attn = Attention(spec, layer_idx, dtype, tp)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype)
        if spec.moe is not None and spec.moe.is_sparse(layer_idx if global_idx is None else global_idx):
            self.mlp = SparseMoeBlock(spec.hidden_size, spec.moe, dtype, tp, expert_parallel)
            return
        tp_size = tp.size if tp else 1
        if spec.intermediate_size % tp_size:
            raise ModelLoadError(f"tensor_parallel_size {tp_size} must divide intermediate_size "
                                 f"{spec.intermediate_size}")
        self.mlp = GatedMLP(spec.hidden_size, spec.intermediate_size // tp_size, spec.mlp_bias, dtype, tp)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionBackend) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, attn)
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaModel(nn.Module):
    """Decoder-only LM: `forward` gives final hidden states, `compute_logits` the float32 logits.

    Built for one rank of a parallel instance when given a `ShardPlan` and its communicators: it then
    holds only its stage's layers (embedding on the first stage, norm and LM head on the last) and
    its tensor-parallel share of each; by default it is the whole model.
    """

    def __init__(self, spec: ModelSpec, dtype: torch.dtype = torch.float32, shard: ShardPlan = ShardPlan(),
                 tp: TPComm | None = None, link: StageLink | None = None) -> None:
        super().__init__()
        self.spec, self.shard, self.link = spec, shard, link
        self.layer_range = shard.layers(spec.num_layers)
        self.embed_tokens = VocabParallelEmbedding(spec.vocab_size, spec.hidden_size, dtype, tp) \
            if shard.is_first_stage else None
        self.layers = nn.ModuleList(DecoderLayer(spec, i, dtype, tp, start + i, shard.expert_parallel)
                                    for start in [self.layer_range.start] for i in range(len(self.layer_range)))
        if shard.is_last_stage:
            self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype)
            self.lm_head = ParallelLMHead(spec.vocab_size, spec.hidden_size, dtype, tp)
            self.tie_weights()
        else:
            self.norm = self.lm_head = None
        self.rotary = RotaryEmbedding(spec.rope, spec.head_dim, spec.max_position_embeddings, dtype)
        self._dtype = dtype

    def tie_weights(self) -> None:
        """A tied LM head shares the embedding's (tensor-parallel) shard when this stage has both."""
        if self.spec.tie_word_embeddings and self.embed_tokens is not None and self.lm_head is not None:
            self.lm_head.weight = self.embed_tokens.weight

    # facts the engine sizes its KV cache with
    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def num_kv_heads(self) -> int:
        return self.layers[0].self_attn.num_kv_heads if len(self.layers) else self.spec.num_kv_heads

    @property
    def head_dim(self) -> int:
        return self.spec.head_dim

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    @property
    def device(self) -> torch.device:
        return self.rotary.cos.device

    def ensure_positions(self, num_positions: int) -> None:
        """Grow the rotary tables so positions [0, num_positions) are valid (default: max_position_embeddings)."""
        if num_positions > self.rotary.num_positions:
            self.rotary.build(num_positions, self.device)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend) -> torch.Tensor:
        """input_ids, positions: [T] -> final-norm hidden states [T, hidden_size].

        A later pipeline stage receives its input hidden states from the previous stage; an earlier one
        sends its output on and returns it un-normed.
        """
        if self.embed_tokens is not None:
            h = self.embed_tokens(input_ids)
        else:
            h = self.link.recv((input_ids.shape[0], self.spec.hidden_size), self._dtype)
        cos, sin = self.rotary(positions)
        for layer in self.layers:
            h = layer(h, cos, sin, attn)
        if self.norm is None:
            self.link.send(h)
            return h
        return self.norm(h)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """hidden [N, hidden_size] -> float32 logits [N, vocab_size] (None on tensor-parallel ranks > 0).

        The head runs in the model's dtype and its output is upcast, as HF does: the sampler and
        logprobs then work in float32 (a prepacked head returns the model's dtype)."""
        logits = self.lm_head(hidden)
        return None if logits is None else logits.float()

    # HF checkpoint names -> our fused parameters: (fused name, shard index)
    _FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
              "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def load_weights(self, weights: Iterable[tuple[str, "Checkpointed"]]) -> None:
        """Copy this rank's part of HF-named tensors into our parameters (casting to our dtype).

        `weights` may yield lazy slices (safetensors' get_slice): only this rank's rows or columns
        are then read, so no rank materialises a tensor it does not hold. Raises if any is missing.
        """
        params = dict(self.named_parameters())  # a tied lm_head appears once
        moe_blocks = {f"layers.{i}.mlp": layer.mlp for i, layer in enumerate(self.layers)
                      if isinstance(layer.mlp, SparseMoeBlock)}
        needed: set[tuple[str, int | str]] = {(prefix, key) for prefix, block in moe_blocks.items()
                                              for key in block.checkpoint_keys()}
        for name in params:
            if ".".join(name.split(".")[:3]) in moe_blocks:
                continue
            module = name.split(".")[-2]
            needed |= {(name, s) for f, s in self._FUSED.values() if f == module} or {(name, -1)}
        for hf_name, tensor in weights:
            name = hf_name.removeprefix("model.")
            if "rotary_emb" in name or (name == "lm_head.weight" and self.spec.tie_word_embeddings):
                continue
            parts = name.split(".")
            if parts[0] == "layers":
                local = int(parts[1]) - self.layer_range.start
                if not 0 <= local < len(self.layer_range):
                    continue  # another pipeline stage's layer
                parts[1] = str(local)
                # Mixtral's checkpoints call the MoE block block_sparse_moe, the Qwen models mlp
                block = f"layers.{local}.mlp" if len(parts) > 3 and parts[2] in ("mlp", "block_sparse_moe") else ""
                if block in moe_blocks:
                    filled = moe_blocks[block].load_checkpoint_tensor(".".join(parts[3:]), tensor, hf_name)
                    needed -= {(block, key) for key in filled}
                    continue
            shard, hf_module = -1, parts[-2] if len(parts) >= 2 else ""
            if hf_module in self._FUSED:
                fused, shard = self._FUSED[hf_module]
                parts[-2] = fused
            name = ".".join(parts)
            if name == "embed_tokens.weight" and self.embed_tokens is None:
                if not (self.spec.tie_word_embeddings and self.lm_head is not None):
                    continue
                name = "lm_head.weight"  # a tied head on a later stage than the embedding loads its own copy
            elif name in ("norm.weight", "lm_head.weight") and self.norm is None:
                continue
            if name not in params:
                raise ModelLoadError(f"checkpoint tensor {hf_name!r} does not belong to a {self.spec.architecture} "
                                     f"with this config.json")
            target = self._shard(params[name], name, shard)
            piece = self._rank_piece(tensor, hf_module, parts[-1], name, hf_name, target)
            with torch.no_grad():
                if piece.shape[0] < target.shape[0]:  # the padded tail of a vocab-parallel table
                    target[piece.shape[0]:].zero_()
                    target = target[:piece.shape[0]]
                target.copy_(piece)
            needed.discard((name, shard))
        if needed:
            missing = sorted(f"{n}[{s}]" if s != -1 else n for n, s in needed)
            raise ModelLoadError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:5]}")

    def _rank_piece(self, tensor: "Checkpointed", hf_module: str, kind: str, name: str, hf_name: str,
                    target: torch.Tensor) -> torch.Tensor:
        """This rank's rows (column-parallel, vocab) or columns (row-parallel) of a checkpoint tensor."""
        shape = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else tuple(tensor.get_shape())
        spec, d, tp, rank = self.spec, self.spec.head_dim, self.shard.tp_size, self.shard.tp_rank
        heads = HeadShard.of(spec, tp, rank)
        inter = spec.intermediate_size // tp
        rows = {"q_proj": (heads.q_start * d, heads.num_heads * d, spec.num_heads * d),
                "k_proj": (heads.kv_start * d, heads.num_kv_heads * d, spec.num_kv_heads * d),
                "gate_proj": (rank * inter, inter, spec.intermediate_size)}
        rows["v_proj"], rows["up_proj"] = rows["k_proj"], rows["gate_proj"]
        dim = 0
        if hf_module in rows:
            start, size, full = rows[hf_module]
        elif name in ("embed_tokens.weight", "lm_head.weight"):
            start = rank * target.shape[0]
            size, full = max(min(target.shape[0], spec.vocab_size - start), 0), spec.vocab_size
        elif hf_module in ("o_proj", "down_proj") and kind == "weight":
            dim, size = 1, target.shape[1]
            start, full = rank * size, size * tp
        else:
            dim = None
        want = list(target.shape)
        if dim is not None:
            want[dim] = full
        if shape != tuple(want):
            raise ModelLoadError(f"checkpoint tensor {hf_name!r} has shape {shape}, config.json implies {tuple(want)}")
        if dim is None:
            return tensor if isinstance(tensor, torch.Tensor) else tensor[:]
        return _take(tensor, dim, start, size)

    def _shard(self, param: torch.Tensor, name: str, shard: int) -> torch.Tensor:
        if shard < 0:
            return param.data
        if ".qkv_proj." in name:
            attn = self.layers[0].self_attn
            q, kv = attn.q_size, attn.kv_size
            start, size = [(0, q), (q, kv), (q + kv, kv)][shard]
        else:
            size = self.spec.intermediate_size // self.shard.tp_size  # a dense layer's share
            start = shard * size
        return param.data.narrow(0, start, size)
