"""The batch description attention reads, built once per step: slot mapping, prompt spans, decode groups.

Which rows are decodes is the scheduler's `is_prefill` rule, passed in with each span; decodes
are grouped by context length so that padded gathers waste little (none with the native kernel).
For the native kernels the prompt chunks of a step are one `PrefillBatch` read from the cache;
without them each chunk is a `PrefillSpan` for torch SDPA.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

Span = tuple[int, int, list[int], bool]  # (start, num_tokens, block_table, is_prefill) of one request


@dataclass
class PrefillSpan:
    q_start: int  # offset in the flattened step
    q_len: int
    ctx_len: int  # cached prefix + this chunk
    blocks: torch.Tensor | None  # [ceil(ctx_len / block_size)] to gather; None when the chunk is the whole context


@dataclass
class PrefillBatch:
    """Every prompt chunk of a step for the native prefill kernel, which reads K/V from the cache."""
    spans: torch.Tensor  # [P, 3] (q_start, q_len, ctx_len)
    tables: torch.Tensor  # [P, nblk] block tables padded with block 0


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
    prefill_batch: PrefillBatch | None = None  # instead of `prefills`, for the native kernel


def decode_groups(token_index: list[int], ctx_lens: list[int], tables: list[list[int]], block_size: int,
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


def build_metadata(spans: list[Span], block_size: int, native_decode: bool = False,
                   native_prefill: bool = False) -> AttentionMetadata:
    """spans: per request (start, num_tokens, block_table, is_prefill) in flattened order; native_decode: one
    unpadded decode group, native_prefill: a PrefillBatch (for the native kernels), else for torch SDPA."""
    bs = block_size
    slot_chunks, prefills = [], []
    dec_index, dec_lens, dec_tables = [], [], []
    pre_spans, pre_tables = [], []
    offset = 0
    for start, n, table, prefill in spans:
        end = start + n
        positions = torch.arange(start, end)
        blocks = torch.tensor(table, dtype=torch.long)
        slot_chunks.append(blocks[positions // bs] * bs + positions % bs)
        if prefill and native_prefill:
            pre_spans.append((offset, n, end))
            pre_tables.append(table[:-(-end // bs)])
        elif prefill:
            prefills.append(PrefillSpan(offset, n, end, blocks[:-(-end // bs)] if start > 0 else None))
        else:
            dec_index.append(offset)
            dec_lens.append(end)
            dec_tables.append(table)
        offset += n
    decodes = decode_groups(dec_index, dec_lens, dec_tables, bs, None if native_decode else 0.25) if dec_index else []
    batch = None
    if pre_spans:
        nblk = max(len(t) for t in pre_tables)
        batch = PrefillBatch(torch.tensor(pre_spans), torch.tensor([t + [0] * (nblk - len(t)) for t in pre_tables]))
    return AttentionMetadata(torch.cat(slot_chunks), prefills, decodes, batch)
