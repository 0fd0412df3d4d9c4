"""Paged attention on CPU with torch SDPA: one flat KV slot array per layer, no padding in q.

Per step the runner builds one `AttentionMetadata` (slot mapping, per-request gather indices);
each layer writes its new K/V into the slots first and then attends, so a request may read KV
written by another request earlier in the same step (prefix-cache hits on blocks in flight).
Decodes (one query token) run as a single batched SDPA over padded context gathers; prompt
chunks run per request with a causal mask offset by the cached prefix.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class PrefillSpan:
    q_start: int  # offset in the flattened step
    q_len: int
    ctx_len: int  # cached prefix + this chunk
    ctx_slots: torch.Tensor | None  # [ctx_len] slots to gather; None when the chunk is the whole context


@dataclass
class DecodeGroup:
    token_index: torch.Tensor  # [B] offsets of the decode tokens in the flattened step
    ctx_slots: torch.Tensor  # [B, L] padded with slot 0
    mask: torch.Tensor | None  # [B, 1, 1, L] True where attended; None when no padding


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] where each new token's K/V go
    prefills: list[PrefillSpan]
    decodes: list[DecodeGroup]


def _decode_groups(token_index: list[int], ctx_lens: list[int], tables: list[list[int]], block_size: int,
                   max_padding: float = 0.25) -> list[DecodeGroup]:
    """Group decodes by context length so padded gathers waste at most ~max_padding of the reads."""
    order = sorted(range(len(ctx_lens)), key=ctx_lens.__getitem__, reverse=True)
    groups, current = [], []
    for i in order:
        if current and ctx_lens[i] < (1 - max_padding) * ctx_lens[current[0]]:
            groups.append(current)
            current = []
        current.append(i)
    if current:
        groups.append(current)
    out = []
    offsets = torch.arange(block_size)
    for members in groups:
        lens = torch.tensor([ctx_lens[i] for i in members])
        max_len = int(lens[0])
        nblk = -(-max_len // block_size)
        table = torch.tensor([(tables[i] + [0] * nblk)[:nblk] for i in members])
        slots = (table[:, :, None] * block_size + offsets).view(len(members), -1)[:, :max_len]
        mask = None
        if int(lens.min()) != max_len:
            valid = torch.arange(max_len)[None, :] < lens[:, None]
            slots = slots.masked_fill(~valid, 0)
            mask = valid[:, None, None, :]
        out.append(DecodeGroup(torch.tensor([token_index[i] for i in members]), slots, mask))
    return out


class PagedKVCache:
    """KV tensors for all layers: [num_layers, num_blocks * block_size, kv_heads, head_dim]."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: str | torch.device = "cpu") -> None:
        shape = (num_layers, num_blocks * block_size, num_kv_heads, head_dim)
        # empty: pages are touched only when written, so an unused budget costs no resident memory
        self.k = torch.empty(shape, dtype=dtype, device=device)
        self.v = torch.empty(shape, dtype=dtype, device=device)
        self.block_size = block_size

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.tensor([], dtype=dtype).element_size()


class PagedAttention:
    """The engine's attention backend (see ecoserve.model.attention.AttentionBackend)."""

    def __init__(self, cache: PagedKVCache) -> None:
        self.cache = cache
        self.meta: AttentionMetadata | None = None

    def build_metadata(self, spans: list[tuple[int, int, list[int]]]) -> AttentionMetadata:
        """spans: per request (start, num_tokens, block_table) in flattened order."""
        bs = self.cache.block_size
        slot_chunks, prefills = [], []
        dec_index, dec_lens, dec_tables = [], [], []
        offset = 0
        for start, n, table in spans:
            end = start + n
            positions = torch.arange(start, end)
            blocks = torch.tensor(table, dtype=torch.long)
            slot_chunks.append(blocks[positions // bs] * bs + positions % bs)
            if n == 1 and start > 0:
                dec_index.append(offset)
                dec_lens.append(end)
                dec_tables.append(table)
            else:
                ctx_slots = None
                if start > 0:
                    ctx = torch.arange(end)
                    ctx_slots = blocks[ctx // bs] * bs + ctx % bs
                prefills.append(PrefillSpan(offset, n, end, ctx_slots))
            offset += n
        decodes = _decode_groups(dec_index, dec_lens, dec_tables, bs) if dec_index else []
        return AttentionMetadata(torch.cat(slot_chunks), prefills, decodes)

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 scale: float) -> torch.Tensor:
        meta = self.meta
        k_cache, v_cache = self.cache.k[layer_idx], self.cache.v[layer_idx]
        k_cache.index_copy_(0, meta.slot_mapping, k)
        v_cache.index_copy_(0, meta.slot_mapping, v)
        gqa = q.shape[1] != k.shape[1]
        out = torch.empty_like(q)
        for span in meta.prefills:
            qs = q[span.q_start:span.q_start + span.q_len].transpose(0, 1)
            if span.ctx_slots is None:
                ks = k[span.q_start:span.q_start + span.q_len].transpose(0, 1)
                vs = v[span.q_start:span.q_start + span.q_len].transpose(0, 1)
                o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=gqa)
            else:
                ks = k_cache[span.ctx_slots].transpose(0, 1)
                vs = v_cache[span.ctx_slots].transpose(0, 1)
                past = span.ctx_len - span.q_len
                mask = torch.arange(span.ctx_len)[None, :] <= torch.arange(past, span.ctx_len)[:, None]
                o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale, enable_gqa=gqa)
            out[span.q_start:span.q_start + span.q_len] = o.transpose(0, 1)
        for group in meta.decodes:
            qd = q[group.token_index].unsqueeze(2)  # [B, Hq, 1, D]
            kd = k_cache[group.ctx_slots].transpose(1, 2)  # [B, Hkv, L, D]
            vd = v_cache[group.ctx_slots].transpose(1, 2)
            o = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=group.mask, scale=scale, enable_gqa=gqa)
            out[group.token_index] = o.squeeze(2)
        return out
