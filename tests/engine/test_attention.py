"""Paged attention against dense causal attention, for prompt chunks and decodes of mixed lengths."""
import random

import pytest
import torch
import torch.nn.functional as F

from ecoserve.engine.attention import PagedAttention
from ecoserve.engine.kv_cache import PagedKVCache
from ecoserve.sched.interface import is_prefill


def dense(q, k, v, scale):
    """Reference: each sequence attends causally over its whole history. q,k,v: [L, H, D]."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    return F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True,
                                          scale=scale).transpose(0, 1)


@pytest.mark.parametrize("native", [False, True], ids=["sdpa", "native"])
def test_paged_attention_equals_dense_over_steps(native):
    torch.manual_seed(0)
    rng = random.Random(0)
    bs, hq, hkv, d, nblocks = 4, 6, 2, 8, 64
    cache = PagedKVCache(1, nblocks, bs, hkv, d, torch.float32)
    assert not cache.k.any() and not cache.v.any()  # unwritten slots are zero, never garbage
    attn = PagedAttention(cache, use_native=native)
    free = list(range(nblocks))
    rng.shuffle(free)
    seqs = []  # per sequence: total length, chunks to run, block table, full q/k/v
    for total in [1, 3, 4, 9, 17, 30]:
        table = [free.pop() for _ in range(-(-total // bs))]
        qkv = [torch.randn(total, h, d) for h in (hq, hkv, hkv)]
        seqs.append({"done": 0, "total": total, "table": table, "qkv": qkv})
    scale = d ** -0.5
    while any(s["done"] < s["total"] for s in seqs):
        spans, qs, ks, vs, live = [], [], [], [], []
        for s in seqs:
            left = s["total"] - s["done"]
            if left == 0:
                continue
            n = 1 if s["done"] > 0 and rng.random() < 0.5 else min(left, rng.randint(1, 7))
            start = s["done"]
            spans.append((start, n, s["table"], is_prefill(n, start + n == s["total"])))
            q, k, v = (t[start:start + n] for t in s["qkv"])
            qs.append(q), ks.append(k), vs.append(v), live.append((s, start, n))
            s["done"] += n
        attn.meta = attn.build_metadata(spans)
        if native and attn._prefill is not None:  # every prompt chunk goes to the native prefill kernel
            assert not attn.meta.prefills and (attn.meta.prefill_batch is not None) == any(p for *_, p in spans)
        out = attn(0, torch.cat(qs), torch.cat(ks), torch.cat(vs), scale)
        offset = 0
        for s, start, n in live:
            q, k, v = s["qkv"]
            ref = dense(q[:start + n], k[:start + n], v[:start + n], scale)[start:start + n]
            torch.testing.assert_close(out[offset:offset + n], ref, atol=1e-5, rtol=1e-5)
            offset += n


DTYPE_PAIRS = {"q-bf16-cache-bf16": (torch.bfloat16, torch.bfloat16), "q-f32-cache-bf16": (torch.float32, torch.bfloat16),
               "q-bf16-cache-f32": (torch.bfloat16, torch.float32), "q-f16-cache-f32": (torch.float16, torch.float32)}


@pytest.mark.parametrize("native", [False, True], ids=["sdpa", "native"])
@pytest.mark.parametrize("dtypes", DTYPE_PAIRS.values(), ids=DTYPE_PAIRS.keys())
def test_paged_attention_with_bf16_activations_or_cache(native, dtypes):
    """q in the model's dtype, the cache in its own: new K/V are rounded to the cache's dtype as they are
    written, and both paths attend over those cached values. Reference: float64 dense attention over the
    same values. Tolerance: a float32 result (native or SDPA) is within the float32 tests' 1e-5; a bf16
    one rounds the float32 result once (2^-8 of the value); torch's SDPA in bf16 rounds intermediate
    values to bf16 too (2.3e-3 of the output's scale measured at 300 tokens), so it gets 2^-7 of that scale.
    A float16 q (which the kernels do not take) runs them in float32: one rounding to float16, 2^-11."""
    q_dtype, cache_dtype = dtypes
    torch.manual_seed(0)
    bs, hq, hkv, d, nblocks = 4, 6, 2, 64, 64
    cache = PagedKVCache(1, nblocks, bs, hkv, d, cache_dtype)
    attn = PagedAttention(cache, use_native=native)
    assert (attn._native is not None) == native
    tables = [list(range(i * 8, i * 8 + 8)) for i in range(3)]
    totals = [5, 13, 30]
    qkv = [[torch.randn(t, h, d).to(q_dtype) for h in (hq, hkv, hkv)] for t in totals]
    scale = d ** -0.5
    # step 1: the prompts but their last 2 tokens (prefills), step 2: the next token (a prefix-cached
    # prefill chunk for the first, decodes for the others), step 3: decodes
    done = [0, 0, 0]
    for step in range(3):
        spans, qs, ks, vs = [], [], [], []
        for i, total in enumerate(totals):
            n = total - 2 if step == 0 else 1
            spans.append((done[i], n, tables[i], step == 0 or (step == 1 and i == 0)))
            q, k, v = (t[done[i]:done[i] + n] for t in qkv[i])
            qs.append(q), ks.append(k), vs.append(v)
            done[i] += n
        attn.meta = attn.build_metadata(spans)
        out = attn(0, torch.cat(qs), torch.cat(ks), torch.cat(vs), scale)
        assert out.dtype == q_dtype
        offset = 0
        for i, (start, n, _, _) in enumerate(spans):
            q, k, v = qkv[i]
            cached = [t[:start + n].to(cache_dtype).double() for t in (k, v)]
            ref = dense(q[:start + n].double(), *cached, scale)[start:start + n]
            got = out[offset:offset + n].double()
            if q_dtype == torch.float32:
                torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
            elif native:
                half_step = 2.0 ** -11 if q_dtype == torch.float16 else 2.0 ** -8
                torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5 + half_step)
            else:
                torch.testing.assert_close(got, ref, atol=2.0 ** -7 * float(ref.abs().max()), rtol=0)
            offset += n


@pytest.mark.parametrize("head_dim", [32, 64, 80, 128])
@pytest.mark.parametrize("num_seqs", [1, 5])
@pytest.mark.parametrize("threads", [1, 2])
def test_native_decode_kernel_equals_sdpa(head_dim, num_seqs, threads, torch_threads):
    """The SIMD rows (head dims a multiple of the vector width), the plain loops (80), one sequence
    (its kv heads split between tasks) and several of unequal lengths (split between threads by
    length), over blocks scattered through the cache."""
    from ecoserve.kernels import paged_decode

    kernel = paged_decode()
    if kernel is None:
        pytest.skip("no native kernel on this machine")
    torch_threads(threads)
    _check_native_decode(kernel, head_dim, num_seqs)


def _check_native_decode(kernel, head_dim, num_seqs):
    torch.manual_seed(head_dim + num_seqs)
    bs, hq, hkv, nblocks = 16, 8, 2, 64
    k_cache, v_cache = torch.randn(nblocks, bs, hkv, head_dim), torch.randn(nblocks, bs, hkv, head_dim)
    lens = torch.tensor([1, 16, 17, 100, 63][:num_seqs])
    tables = torch.randperm(nblocks)[:num_seqs * 7].view(num_seqs, 7).contiguous()
    q = torch.randn(num_seqs, hq, head_dim)
    out = kernel(q, k_cache, v_cache, tables, lens, head_dim ** -0.5)
    for b in range(num_seqs):
        n = int(lens[b])
        k = k_cache[tables[b]].reshape(-1, hkv, head_dim)[:n].transpose(0, 1)
        v = v_cache[tables[b]].reshape(-1, hkv, head_dim)[:n].transpose(0, 1)
        ref = F.scaled_dot_product_attention(q[b].unsqueeze(1), k, v, scale=head_dim ** -0.5, enable_gqa=True)
        torch.testing.assert_close(out[b], ref.squeeze(1), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("head_dim", [8, 64, 80, 128])
@pytest.mark.parametrize("heads", [(6, 2), (4, 4), (8, 1)], ids=["gqa3", "mha", "mqa"])
@pytest.mark.parametrize("threads", [1, 2])
def test_native_prefill_kernel_equals_sdpa(head_dim, heads, threads, torch_threads):
    """Prompt chunks with and without a cached prefix, one token to several blocks, over blocks
    scattered through the cache: the compiled head dims (64, 80, 128), the generic loop (8), query
    rows of one kv head filling vector lanes across tokens (gqa3, mqa) or not (mha), tasks shared
    by two threads, q read in place from a wider qkv row."""
    from ecoserve.kernels import paged_prefill

    kernel = paged_prefill()
    if kernel is None:
        pytest.skip("no native prefill kernel on this machine")
    torch_threads(threads)
    _check_native_prefill(kernel, head_dim, *heads)


def _check_native_prefill(kernel, head_dim, hq, hkv):
    torch.manual_seed(head_dim + hq)
    bs, nblocks = 16, 128
    chunks = [(1, 1), (5, 5), (17, 40), (100, 100), (3, 250), (33, 33)]  # (q_len, ctx_len): prefix = ctx - q
    k_cache, v_cache = torch.randn(nblocks, bs, hkv, head_dim), torch.randn(nblocks, bs, hkv, head_dim)
    nblk = -(-max(c for _, c in chunks) // bs)
    tables = torch.randperm(nblocks)[:len(chunks) * nblk].view(len(chunks), nblk).contiguous()
    starts = [sum(n for n, _ in chunks[:i]) for i in range(len(chunks))]
    spans = torch.tensor([[s, n, c] for s, (n, c) in zip(starts, chunks)])
    # q as the model passes it: a view into the fused qkv output (tokens strided, heads contiguous)
    q = torch.randn(sum(n for n, _ in chunks), hq + 2 * hkv, head_dim)[:, :hq]
    out = torch.full(q.shape, float("nan"))
    kernel(q, k_cache, v_cache, out, tables, spans, head_dim ** -0.5)
    for (n, ctx), start, table in zip(chunks, starts, tables):
        k = k_cache[table].reshape(-1, hkv, head_dim)[:ctx].transpose(0, 1).unsqueeze(0)
        v = v_cache[table].reshape(-1, hkv, head_dim)[:ctx].transpose(0, 1).unsqueeze(0)
        mask = torch.arange(ctx)[None, :] <= torch.arange(ctx - n, ctx)[:, None]
        ref = F.scaled_dot_product_attention(q[start:start + n].transpose(0, 1).unsqueeze(0), k, v, attn_mask=mask,
                                             scale=head_dim ** -0.5, enable_gqa=True)
        torch.testing.assert_close(out[start:start + n], ref[0].transpose(0, 1), atol=1e-5, rtol=1e-5)


def test_native_prefill_kernel_rejects_bad_spans_and_tensors():
    """A span past q's rows or the block table, a float64 q or a non-contiguous cache: a clear error,
    and nothing written to out."""
    from ecoserve.kernels import paged_prefill

    kernel = paged_prefill()
    if kernel is None:
        pytest.skip("no native prefill kernel on this machine")
    k_cache = v_cache = torch.zeros(4, 16, 2, 64)
    q, out = torch.randn(8, 4, 64), torch.zeros(8, 4, 64)
    tables = torch.tensor([[0, 1]])
    for spans, message in [([[0, 9, 9]], "outside the 8 query rows"), ([[0, 4, 40]], r"context length 40 .* outside"),
                           ([[0, 5, 4]], "attends fewer tokens than it computes")]:
        with pytest.raises(RuntimeError, match=message):
            kernel(q, k_cache, v_cache, out, tables, torch.tensor(spans), 0.125)
    with pytest.raises(RuntimeError, match="must be float32 or bfloat16 alike"):
        kernel(q.double(), k_cache, v_cache, out, tables, torch.tensor([[0, 4, 4]]), 0.125)
    with pytest.raises(RuntimeError, match="must be float32 or bfloat16 alike"):  # out's dtype is q's
        kernel(q.bfloat16(), k_cache, v_cache, out, tables, torch.tensor([[0, 4, 4]]), 0.125)
    with pytest.raises(RuntimeError, match="contiguous"):
        kernel(q, k_cache.transpose(0, 1), v_cache, out, tables, torch.tensor([[0, 4, 4]]), 0.125)
    assert not out.any()


def test_bf16_prompt_chunks_go_to_sdpa_only_where_amx_runs_it(monkeypatch):
    """On an AMX-BF16 CPU torch's SDPA is the faster prompt attention over a bf16 cache; decodes stay
    native, a float32 cache keeps both kernels, and use_native=True forces both."""
    import ecoserve.engine.attention as attention
    from ecoserve.kernels import cpu

    cache = PagedKVCache(1, 8, 4, 2, 16, torch.bfloat16)
    for flags, expect_prefill in [({"avx512f", "amx_bf16"}, False), ({"avx512f", "avx512_bf16"}, True)]:
        monkeypatch.setattr(cpu, "capabilities", lambda flags=flags: cpu.CpuCapabilities.from_flags(flags))
        attn = PagedAttention(cache)
        if attn._native is None:
            pytest.skip("no native kernel on this machine")
        assert (attn._prefill is not None) == (expect_prefill and attention.paged_prefill() is not None)
        assert PagedAttention(cache, use_native=True)._prefill is attention.paged_prefill()
        f32 = PagedAttention(PagedKVCache(1, 8, 4, 2, 16, torch.float32))
        assert f32._prefill is attention.paged_prefill()
