"""Paged attention on CPU with torch SDPA: one flat KV slot array per layer, no padding in q.

Per step the runner builds one `AttentionMetadata` (slot mapping, per-request gather indices);
each layer writes its new K/V into the slots first and then attends, so a request may read KV
written by another request earlier in the same step (prefix-cache hits on blocks in flight).
Decodes (one query token) run in one call of a native kernel that reads K/V straight from the
blocks (ecoserve.kernels), or, without it, as batched SDPA over padded block gathers;
prompt chunks attend causally, offset by the cached prefix: all of a step's in one call of the
native prefill kernel (reading the blocks too), or per request with SDPA.

The cache may hold another dtype than the model's activations (a float32 cache under a bfloat16
model): new K/V are rounded to the cache's dtype as they are written, and SDPA reads them back in
q's dtype, so both paths attend over the same cached values. The native kernels take q and the
cache each in float32 or bfloat16 and accumulate in float32.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ecoserve.engine.attention_metadata import AttentionMetadata, Span, build_metadata
from ecoserve.kernels import paged_decode, paged_prefill
from ecoserve.kernels.paths import sdpa_prefill_is_faster
from ecoserve.engine.kv_cache import PagedKVCache


NATIVE_DTYPES = (torch.float32, torch.bfloat16)  # of q and of the cache, in any pairing


class PagedAttention:
    """The engine's attention backend (see ecoserve.model.attention.AttentionBackend)."""

    def __init__(self, cache: PagedKVCache, use_native: bool | None = None) -> None:
        """use_native: True forces both native kernels (an error if the decode kernel cannot be built),
        False uses neither, None picks per kernel (sdpa_prefill_is_faster)."""
        self.cache = cache
        self.meta: AttentionMetadata | None = None
        native = prefill = None
        if use_native is not False and cache.k.dtype in NATIVE_DTYPES and cache.k.device.type == "cpu":
            native = paged_decode()
            if use_native or not sdpa_prefill_is_faster(cache.k.dtype):
                prefill = paged_prefill()
        if use_native and native is None:
            raise RuntimeError("the native paged decode kernel was asked for but could not be built")
        self._native, self._prefill = native, prefill  # the prefill kernel needs AVX2 or AVX-512

    def build_metadata(self, spans: list[Span]) -> AttentionMetadata:
        """spans: per request (start, num_tokens, block_table, is_prefill) in flattened order."""
        return build_metadata(spans, self.cache.block_size, self._native is not None, self._prefill is not None)

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 scale: float) -> torch.Tensor:
        meta = self.meta
        k_cache, v_cache = self.cache.k[layer_idx], self.cache.v[layer_idx]  # [blocks, bs, Hkv, D]
        hkv, d = k.shape[1], k.shape[2]
        cache_dtype = k_cache.dtype
        k_cache.view(-1, hkv, d).index_copy_(0, meta.slot_mapping, k.to(cache_dtype))
        v_cache.view(-1, hkv, d).index_copy_(0, meta.slot_mapping, v.to(cache_dtype))
        gqa = q.shape[1] != k.shape[1]
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # q may be a view into the qkv output
        if meta.prefill_batch is not None:
            batch = meta.prefill_batch
            if q.dtype in NATIVE_DTYPES:
                self._prefill(q, k_cache, v_cache, out, batch.tables, batch.spans, scale)
            else:  # another activation dtype (float16): the kernel runs in float32
                out32 = torch.empty(q.shape, dtype=torch.float32, device=q.device)
                self._prefill(q.float(), k_cache, v_cache, out32, batch.tables, batch.spans, scale)
                out.copy_(out32)
        for span in meta.prefills:
            # 4-D [1, H, T, D] inputs: the CPU flash kernel takes them (3-D ones with a mask fall back to
            # the slow math path)
            q_slice = slice(span.q_start, span.q_start + span.q_len)
            qs = q[q_slice].transpose(0, 1).unsqueeze(0)
            if span.blocks is None:  # the chunk's own K/V, rounded as the cache holds them
                ks, vs = k[q_slice].to(cache_dtype).to(q.dtype), v[q_slice].to(cache_dtype).to(q.dtype)
                mask = None
            else:
                ks = k_cache[span.blocks].view(-1, hkv, d)[:span.ctx_len].to(q.dtype)
                vs = v_cache[span.blocks].view(-1, hkv, d)[:span.ctx_len].to(q.dtype)
                past = span.ctx_len - span.q_len
                mask = torch.arange(span.ctx_len)[None, :] <= torch.arange(past, span.ctx_len)[:, None]
            o = F.scaled_dot_product_attention(qs, ks.transpose(0, 1).unsqueeze(0), vs.transpose(0, 1).unsqueeze(0),
                                               attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=gqa)
            out[q_slice] = o[0].transpose(0, 1)
        for group in meta.decodes:
            if self._native is not None:
                qd = q[group.token_index]
                qd = qd if qd.dtype in NATIVE_DTYPES else qd.float()
                out[group.token_index] = self._native(qd, k_cache, v_cache, group.blocks, group.lens, scale).to(q.dtype)
                continue
            b = group.blocks.shape[0]
            qd = q[group.token_index].unsqueeze(2)  # [B, Hq, 1, D]
            kd = k_cache[group.blocks].view(b, -1, hkv, d).transpose(1, 2).to(q.dtype)  # [B, Hkv, L, D]
            vd = v_cache[group.blocks].view(b, -1, hkv, d).transpose(1, 2).to(q.dtype)
            o = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=group.mask, scale=scale, enable_gqa=gqa)
            out[group.token_index] = o.squeeze(2)
        return out
