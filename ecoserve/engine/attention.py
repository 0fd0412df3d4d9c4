"""Paged attention on CPU with torch SDPA: one flat KV slot array per layer, no padding in q.

Per step the runner builds one `AttentionMetadata` (slot mapping, per-request gather indices);
each layer writes its new K/V into the slots first and then attends, so a request may read KV
written by another request earlier in the same step (prefix-cache hits on blocks in flight).
Decodes (one query token) run in one call of a native kernel that reads K/V straight from the
blocks (ecoserve.engine.kernels), or, without it, as batched SDPA over padded block gathers;
prompt chunks run per request with a causal mask offset by the cached prefix.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ecoserve.engine.kernels import paged_decode


@dataclass
class PrefillSpan:
    q_start: int  # offset in the flattened step
    q_len: int
    ctx_len: int  # cached prefix + this chunk
    blocks: torch.Tensor | None  # [ceil(ctx_len / block_size)] to gather; None when the chunk is the whole context


@dataclass
class DecodeGroup:
    token_index: torch.Tensor  # [B] offsets of the decode tokens in the flattened step
    blocks: torch.Tensor  # [B, nblk] block tables padded with block 0
    mask: torch.Tensor | None  # [B, 1, 1, nblk * block_size] True where attended; None when nothing is padded
    lens: torch.Tensor  # [B] context lengths


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] where each new token's K/V go
    prefills: list[PrefillSpan]
    decodes: list[DecodeGroup]


def _decode_groups(token_index: list[int], ctx_lens: list[int], tables: list[list[int]], block_size: int,
                   max_padding: float | None = 0.25) -> list[DecodeGroup]:
    """Group decodes by context length so padded gathers waste at most ~max_padding of the reads.

    max_padding None: one group (the native kernel reads only each sequence's own length).
    """
    order = sorted(range(len(ctx_lens)), key=ctx_lens.__getitem__, reverse=True)
    groups, current = [], []
    for i in order:
        if current and max_padding is not None and ctx_lens[i] < (1 - max_padding) * ctx_lens[current[0]]:
            groups.append(current)
            current = []
        current.append(i)
    if current:
        groups.append(current)
    out = []
    for members in groups:
        lens = torch.tensor([ctx_lens[i] for i in members])
        nblk = -(-int(lens[0]) // block_size)
        table = torch.tensor([(tables[i] + [0] * nblk)[:nblk] for i in members])
        mask = None
        if max_padding is not None and int(lens.min()) != nblk * block_size:
            mask = (torch.arange(nblk * block_size)[None, :] < lens[:, None])[:, None, None, :]
        out.append(DecodeGroup(torch.tensor([token_index[i] for i in members]), table, mask, lens))
    return out


class PagedKVCache:
    """KV tensors for all layers: [num_layers, num_blocks, block_size, kv_heads, head_dim].

    Reads gather whole blocks (contiguous runs of block_size tokens), which moves memory several
    times faster on CPU than gathering token slots one by one.
    """

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: str | torch.device = "cpu") -> None:
        shape = (num_layers, num_blocks, block_size, num_kv_heads, head_dim)
        # zeros, not empty: padded decode gathers read unwritten slots (masked out), and garbage that
        # happens to be NaN would poison the masked softmax (0 * NaN = NaN)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.block_size = block_size

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * dtype.itemsize


class PagedAttention:
    """The engine's attention backend (see ecoserve.model.attention.AttentionBackend)."""

    def __init__(self, cache: PagedKVCache, use_native: bool | None = None) -> None:
        self.cache = cache
        self.meta: AttentionMetadata | None = None
        native = None
        if use_native is not False and cache.k.dtype == torch.float32 and cache.k.device.type == "cpu":
            native = paged_decode()
        if use_native and native is None:
            raise RuntimeError("the native paged decode kernel was asked for but could not be built")
        self._native = native

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
                prefills.append(PrefillSpan(offset, n, end, blocks[:-(-end // bs)] if start > 0 else None))
            offset += n
        decodes = _decode_groups(dec_index, dec_lens, dec_tables, bs,
                                 None if self._native else 0.25) if dec_index else []
        return AttentionMetadata(torch.cat(slot_chunks), prefills, decodes)

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 scale: float) -> torch.Tensor:
        meta = self.meta
        k_cache, v_cache = self.cache.k[layer_idx], self.cache.v[layer_idx]  # [blocks, bs, Hkv, D]
        hkv, d = k.shape[1], k.shape[2]
        k_cache.view(-1, hkv, d).index_copy_(0, meta.slot_mapping, k)
        v_cache.view(-1, hkv, d).index_copy_(0, meta.slot_mapping, v)
        gqa = q.shape[1] != k.shape[1]
        out = torch.empty_like(q)
        for span in meta.prefills:
            # 4-D [1, H, T, D] inputs: the CPU flash kernel takes them (3-D ones with a mask fall back to
            # the slow math path)
            q_slice = slice(span.q_start, span.q_start + span.q_len)
            qs = q[q_slice].transpose(0, 1).unsqueeze(0)
            if span.blocks is None:
                ks, vs = k[q_slice], v[q_slice]
                mask = None
            else:
                ks = k_cache[span.blocks].view(-1, hkv, d)[:span.ctx_len]
                vs = v_cache[span.blocks].view(-1, hkv, d)[:span.ctx_len]
                past = span.ctx_len - span.q_len
                mask = torch.arange(span.ctx_len)[None, :] <= torch.arange(past, span.ctx_len)[:, None]
            o = F.scaled_dot_product_attention(qs, ks.transpose(0, 1).unsqueeze(0), vs.transpose(0, 1).unsqueeze(0),
                                               attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=gqa)
            out[q_slice] = o[0].transpose(0, 1)
        for group in meta.decodes:
            if self._native is not None:
                out[group.token_index] = self._native(q[group.token_index], k_cache, v_cache, group.blocks, group.lens,
                                                      scale)
                continue
            b = group.blocks.shape[0]
            qd = q[group.token_index].unsqueeze(2)  # [B, Hq, 1, D]
            kd = k_cache[group.blocks].view(b, -1, hkv, d).transpose(1, 2)  # [B, Hkv, L, D]
            vd = v_cache[group.blocks].view(b, -1, hkv, d).transpose(1, 2)
            o = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=group.mask, scale=scale, enable_gqa=gqa)
            out[group.token_index] = o.squeeze(2)
        return out
