"""Time the native paged attention kernels per (q dtype, cache dtype), against torch SDPA over gathered blocks.

Decode: `--seqs` sequences of about `--context` cached tokens (lengths spread +-10%), one query token
each. Prefill: `--prompts` prompts of `--prompt-len` tokens with no cached prefix. Blocks are scattered
through the cache as the engine's allocator leaves them. Prints one row per path: the median time of
`--repeats` calls after a warm-up, and for prefill the causal attention GFLOP/s. Pin it to one core
for the single-core figures: `taskset -c 0 python scripts/bench_attention_kernels.py --threads 1`; `--kernels
decode` times the decode rows alone (best of several runs on a busy machine: `--runs 5`).
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from ecoserve import kernels
from ecoserve.bench.roofline import median_ms

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
PAIRS = [("float32", "float32"), ("float32", "bfloat16"), ("bfloat16", "float32"), ("bfloat16", "bfloat16")]


def scattered_tables(lengths: list[int], block_size: int) -> tuple[torch.Tensor, int]:
    """Block tables [n, max_blocks] over a shuffled cache, and the cache's block count."""
    need = [-(-n // block_size) for n in lengths]
    ids = torch.randperm(sum(need))
    width, rows, at = max(need), [], 0
    for k in need:
        rows.append(torch.cat([ids[at:at + k], torch.zeros(width - k, dtype=torch.long)]))
        at += k
    return torch.stack(rows).contiguous(), sum(need)


def bench_decode(args, decode) -> None:
    gen = torch.Generator().manual_seed(0)
    lens = torch.randint(int(args.context * 0.9), int(args.context * 1.1) + 1, (args.seqs,), generator=gen)
    tables, nblocks = scattered_tables(lens.tolist(), args.block_size)
    shape = (nblocks, args.block_size, args.kv_heads, args.head_dim)
    k32, v32 = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    q32 = torch.randn(args.seqs, args.heads, args.head_dim, generator=gen)
    scale = args.head_dim ** -0.5
    print(f"decode: {args.seqs} sequences of {int(lens.min())}-{int(lens.max())} tokens, {args.heads} heads over "
          f"{args.kv_heads} kv heads of {args.head_dim}, blocks of {args.block_size}, {torch.get_num_threads()} threads")
    mask = (torch.arange(tables.shape[1] * args.block_size)[None, :] < lens[:, None])[:, None, None, :]
    for q_name, c_name in PAIRS:
        q, k, v = q32.to(DTYPES[q_name]), k32.to(DTYPES[c_name]), v32.to(DTYPES[c_name])
        ms = median_ms(lambda: decode(q, k, v, tables, lens, scale), args.repeats)
        print(f"  native  q {q_name:8s} cache {c_name:8s} {ms:8.3f} ms")
        if q_name == c_name:  # the engine's fallback: gather the blocks, then SDPA with a padding mask
            def sdpa():
                b = tables.shape[0]
                kd = k[tables].view(b, -1, args.kv_heads, args.head_dim).transpose(1, 2)
                vd = v[tables].view(b, -1, args.kv_heads, args.head_dim).transpose(1, 2)
                F.scaled_dot_product_attention(q.unsqueeze(2), kd, vd, attn_mask=mask, scale=scale, enable_gqa=True)
            print(f"  sdpa    q {q_name:8s} cache {c_name:8s} {median_ms(sdpa, args.repeats):8.3f} ms")


def bench_prefill(args, prefill) -> None:
    gen = torch.Generator().manual_seed(1)
    lengths = [args.prompt_len] * args.prompts
    tables, nblocks = scattered_tables(lengths, args.block_size)
    shape = (nblocks, args.block_size, args.kv_heads, args.head_dim)
    k32, v32 = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    tokens = sum(lengths)
    q32 = torch.randn(tokens, args.heads, args.head_dim, generator=gen)
    spans = torch.tensor([[i * args.prompt_len, args.prompt_len, args.prompt_len] for i in range(args.prompts)])
    scale = args.head_dim ** -0.5
    # causal: query i attends i + 1 keys, 2 multiply-adds (QK and PV) per key and dim
    flops = 4 * args.heads * args.head_dim * args.prompts * args.prompt_len * (args.prompt_len + 1) / 2
    print(f"prefill: {args.prompts} prompts of {args.prompt_len} tokens, {args.heads} heads over {args.kv_heads} kv "
          f"heads of {args.head_dim}, {torch.get_num_threads()} threads")
    for q_name, c_name in PAIRS:
        q, k, v = q32.to(DTYPES[q_name]), k32.to(DTYPES[c_name]), v32.to(DTYPES[c_name])
        out = torch.empty_like(q)
        ms = median_ms(lambda: prefill(q, k, v, out, tables, spans, scale), args.repeats)
        print(f"  native  q {q_name:8s} cache {c_name:8s} {ms:8.3f} ms {flops / ms / 1e6:7.1f} GFLOP/s")
        if q_name == c_name:  # the engine's fallback: SDPA per prompt over its own K/V
            kq = k[tables].view(args.prompts, -1, args.kv_heads, args.head_dim)[:, :args.prompt_len].transpose(1, 2)
            vq = v[tables].view(args.prompts, -1, args.kv_heads, args.head_dim)[:, :args.prompt_len].transpose(1, 2)
            qq = q.view(args.prompts, args.prompt_len, args.heads, args.head_dim).transpose(1, 2)

            def sdpa():
                for i in range(args.prompts):
                    F.scaled_dot_product_attention(qq[i:i + 1], kq[i:i + 1], vq[i:i + 1], is_causal=True, scale=scale,
                                                   enable_gqa=True)
            ms = median_ms(sdpa, args.repeats)
            print(f"  sdpa    q {q_name:8s} cache {c_name:8s} {ms:8.3f} ms {flops / ms / 1e6:7.1f} GFLOP/s")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    ap.add_argument("--isa", default=None, help="native (default) or avx2: the kernels' build (ECOSERVE_CPU_ISA)")
    ap.add_argument("--seqs", type=int, default=64)
    ap.add_argument("--context", type=int, default=330)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--kernels", choices=["decode", "prefill", "both"], default="both", help="which kernels to time")
    ap.add_argument("--runs", type=int, default=1, help="time the chosen kernels this many times over")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    decode, prefill = kernels.paged_decode(args.isa), kernels.paged_prefill(args.isa)
    if decode is None or prefill is None:
        print("the native kernels could not be built here")
        return 1
    print(f"kernels: {kernels.target_isa(args.isa)} build, CPU {kernels.isa_tag()}")
    for _ in range(args.runs):
        if args.kernels in ("decode", "both"):
            bench_decode(args, decode)
        if args.kernels in ("prefill", "both"):
            bench_prefill(args, prefill)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
