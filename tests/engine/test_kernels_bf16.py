"""The native kernels' bfloat16 paths against float32 references, on this CPU's build and on an
AVX2-only build of the same sources (ECOSERVE_CPU_ISA=avx2).

Attention: q (and out) and the K/V cache each float32 or bfloat16. The reference is float64 SDPA over
the same values the kernel reads (bf16 inputs widened exactly), so the kernel's only errors are its
float32 accumulation (the float32 tests' 1e-5) and, for a bf16 out, one rounding of the float32 result
to bf16 (at most half a bf16 step, 2^-8 of the value): the tolerance is the sum of the two. A bf16 out
must moreover be bit for bit the float32 out of the same inputs rounded to bf16 as torch rounds.

Fused ops in bfloat16 against the torch ops HF's bf16 modules run: rotary bit-equal; SiLU-and-mul and
RMSNorm round where torch rounds, but compute one float32 value differently (the exponential's
polynomial, the sum of squares' order), so a value on a bf16 rounding boundary may land one step
away (two for RMSNorm, whose normalised row is rounded and then multiplied by the weight and rounded
again): within 2^-7 (2^-6) of the value, and nearly all elements bit-equal.
"""
import pytest
import torch
import torch.nn.functional as F

from ecoserve import kernels
from ecoserve.model.fused import native_for
from ecoserve.model.layers import GatedMLP, RMSNorm
from ecoserve.model.rope import apply_rotary

ISAS = kernels.distinct_builds()  # avx2 too where that build differs from this CPU's
DTYPE_PAIRS = {"q-bf16-cache-bf16": (torch.bfloat16, torch.bfloat16), "q-f32-cache-bf16": (torch.float32, torch.bfloat16),
               "q-bf16-cache-f32": (torch.bfloat16, torch.float32), "q-f32-cache-f32": (torch.float32, torch.float32)}
F32_ATOL = F32_RTOL = 1e-5  # float32 accumulation, as the float32 kernel tests
HALF_BF16_STEP = 2.0 ** -8  # the largest relative error of rounding a float32 to bf16 (round to nearest)


def _loaded(loader, isa):
    fn = loader(isa)
    if fn is None:
        pytest.skip(f"no native kernel for {isa} on this machine (compiler or CPU)")
    return fn


def _tolerance(q_dtype):
    rtol = F32_RTOL + (HALF_BF16_STEP if q_dtype == torch.bfloat16 else 0.0)
    return {"atol": F32_ATOL, "rtol": rtol}


def _assert_rounds_like_torch(kernel_call, q, out):
    """A bf16 out is exactly the float32 out of the same (widened) inputs rounded by torch."""
    if q.dtype == torch.bfloat16:
        assert torch.equal(out, kernel_call(q.float()).bfloat16())


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtypes", DTYPE_PAIRS.values(), ids=DTYPE_PAIRS.keys())
@pytest.mark.parametrize("head_dim", [32, 64, 80, 128])
@pytest.mark.parametrize("num_seqs", [1, 5])
@pytest.mark.parametrize("threads", [1, 2])
def test_decode_kernel_dtypes_against_float64(isa, dtypes, head_dim, num_seqs, threads, torch_threads):
    """SIMD rows (head dims a multiple of the vector width), the plain loops (80; on AVX2 also a
    multiple of 8 the kernel has no unrolled count for), kv heads split between tasks (one sequence)
    or sequences between threads, blocks scattered through the cache; GQA 4:1."""
    kernel = _loaded(kernels.paged_decode, isa)
    torch_threads(threads)
    q_dtype, cache_dtype = dtypes
    torch.manual_seed(head_dim + num_seqs)
    bs, hq, hkv, nblocks = 16, 8, 2, 64
    k_cache, v_cache = (torch.randn(nblocks, bs, hkv, head_dim).to(cache_dtype) for _ in range(2))
    lens = torch.tensor([1, 16, 17, 100, 63][:num_seqs])
    tables = torch.randperm(nblocks)[:num_seqs * 7].view(num_seqs, 7).contiguous()
    q = torch.randn(num_seqs, hq, head_dim).to(q_dtype)
    scale = head_dim ** -0.5
    call = lambda q_: kernel(q_, k_cache, v_cache, tables, lens, scale)  # noqa: E731
    out = call(q)
    assert out.dtype == q_dtype
    for b in range(num_seqs):
        n = int(lens[b])
        k = k_cache[tables[b]].reshape(-1, hkv, head_dim)[:n].transpose(0, 1).double()
        v = v_cache[tables[b]].reshape(-1, hkv, head_dim)[:n].transpose(0, 1).double()
        ref = F.scaled_dot_product_attention(q[b].double().unsqueeze(1), k, v, scale=scale, enable_gqa=True)
        torch.testing.assert_close(out[b].double(), ref.squeeze(1), **_tolerance(q_dtype))
    _assert_rounds_like_torch(call, q, out)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtypes", [DTYPE_PAIRS["q-bf16-cache-bf16"], DTYPE_PAIRS["q-f32-cache-f32"]],
                         ids=["q-bf16-cache-bf16", "q-f32-cache-f32"])
@pytest.mark.parametrize("block_size", [1, 8, 24, 32])
@pytest.mark.parametrize("heads", [(12, 4), (5, 1), (3, 3), (16, 2)], ids=["gqa3", "gqa5", "mha", "gqa8"])
def test_decode_kernel_block_sizes_and_groups_against_float64(isa, dtypes, block_size, heads):
    """Scores are taken a vector width of tokens at a time within a block, and V summed for groups of
    query rows of one kv head: blocks shorter than the width, longer and not a multiple of it (the last
    chunk partial), contexts ending mid-chunk, and query rows per kv head that are not a multiple of a
    register group (5) or are more than one (8)."""
    kernel = _loaded(kernels.paged_decode, isa)
    q_dtype, cache_dtype = dtypes
    hq, hkv = heads
    head_dim, nblocks = 64, 96
    torch.manual_seed(block_size * 100 + hq)
    k_cache, v_cache = (torch.randn(nblocks, block_size, hkv, head_dim).to(cache_dtype) for _ in range(2))
    lens = torch.tensor([1, 7, 17, 40, 95])
    width = -(-int(lens.max()) // block_size)
    tables = torch.stack([torch.randperm(nblocks)[:width] for _ in lens]).contiguous()
    q = torch.randn(len(lens), hq, head_dim).to(q_dtype)
    out = kernel(q, k_cache, v_cache, tables, lens, head_dim ** -0.5)
    for b in range(len(lens)):
        n = int(lens[b])
        k = k_cache[tables[b]].reshape(-1, hkv, head_dim)[:n].transpose(0, 1).double()
        v = v_cache[tables[b]].reshape(-1, hkv, head_dim)[:n].transpose(0, 1).double()
        ref = F.scaled_dot_product_attention(q[b].double().unsqueeze(1), k, v, scale=head_dim ** -0.5,
                                             enable_gqa=True)
        torch.testing.assert_close(out[b].double(), ref.squeeze(1), **_tolerance(q_dtype))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtypes", DTYPE_PAIRS.values(), ids=DTYPE_PAIRS.keys())
@pytest.mark.parametrize("head_dim", [8, 64, 80, 128])
@pytest.mark.parametrize("heads", [(6, 2), (4, 4), (8, 1)], ids=["gqa3", "mha", "mqa"])
@pytest.mark.parametrize("threads", [1, 2])
def test_prefill_kernel_dtypes_against_float64(isa, dtypes, head_dim, heads, threads, torch_threads):
    """Prompt chunks with and without a cached prefix, from one token to several blocks: the unrolled
    head dims (64, 80, 128), the generic loop (8), query rows of one kv head filling vector lanes
    across tokens (gqa3, mqa) or not (mha), q read in place from a wider qkv row."""
    kernel = _loaded(kernels.paged_prefill, isa)
    torch_threads(threads)
    q_dtype, cache_dtype = dtypes
    hq, hkv = heads
    torch.manual_seed(head_dim + hq)
    bs, nblocks = 16, 128
    chunks = [(1, 1), (5, 5), (17, 40), (100, 100), (3, 250), (33, 33)]  # (q_len, ctx_len): prefix = ctx - q
    k_cache, v_cache = (torch.randn(nblocks, bs, hkv, head_dim).to(cache_dtype) for _ in range(2))
    nblk = -(-max(c for _, c in chunks) // bs)
    tables = torch.randperm(nblocks)[:len(chunks) * nblk].view(len(chunks), nblk).contiguous()
    starts = [sum(n for n, _ in chunks[:i]) for i in range(len(chunks))]
    spans = torch.tensor([[s, n, c] for s, (n, c) in zip(starts, chunks)])
    q = torch.randn(sum(n for n, _ in chunks), hq + 2 * hkv, head_dim).to(q_dtype)[:, :hq]  # a view, as the model's
    scale = head_dim ** -0.5

    def call(q_):
        out_ = torch.full(q_.shape, float("nan"), dtype=q_.dtype)
        kernel(q_, k_cache, v_cache, out_, tables, spans, scale)
        return out_

    out = call(q)
    for (n, ctx), start, table in zip(chunks, starts, tables):
        k = k_cache[table].reshape(-1, hkv, head_dim)[:ctx].transpose(0, 1).unsqueeze(0).double()
        v = v_cache[table].reshape(-1, hkv, head_dim)[:ctx].transpose(0, 1).unsqueeze(0).double()
        mask = torch.arange(ctx)[None, :] <= torch.arange(ctx - n, ctx)[:, None]
        ref = F.scaled_dot_product_attention(q[start:start + n].double().transpose(0, 1).unsqueeze(0), k, v,
                                             attn_mask=mask, scale=scale, enable_gqa=True)
        torch.testing.assert_close(out[start:start + n].double(), ref[0].transpose(0, 1), **_tolerance(q_dtype))
    _assert_rounds_like_torch(call, q, out)


# ---- fused ops ----

def _bf16_steps_apart(actual, expected, steps, min_equal=0.99):
    """actual within `steps` bf16 steps (2^-7 of the value each) of expected, and nearly all bit-equal."""
    torch.testing.assert_close(actual.float(), expected.float(), rtol=steps * 2.0 ** -7, atol=1e-6)
    assert (actual == expected).float().mean() >= min_equal


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("threads", [1, 2])
def test_rotary_bf16_is_bit_equal_to_torch(isa, threads, torch_threads):
    """Each product and each sum rounded to bf16, as the torch ops in bf16; v untouched."""
    native = _loaded(kernels.fused_ops, isa)
    torch_threads(threads)
    torch.manual_seed(0)
    T, H, Hkv, D = 300, 6, 2, 64
    qkv = torch.randn(T, (H + 2 * Hkv) * D).bfloat16()
    cos, sin = torch.randn(T, 1, D // 2).bfloat16(), torch.randn(T, 1, D // 2).bfloat16()
    q, k, v = (t.reshape(T, -1, D) for t in qkv.split([H * D, Hkv * D, Hkv * D], dim=-1))
    ref_q, ref_k, v_before = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v.clone()
    native.rotary_(qkv[:, :(H + Hkv) * D].view(T, -1, D), cos, sin)
    q, k, v = (t.reshape(T, -1, D) for t in qkv.split([H * D, Hkv * D, Hkv * D], dim=-1))
    assert torch.equal(q, ref_q) and torch.equal(k, ref_k) and torch.equal(v, v_before)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("rows", [1, 300])
def test_silu_and_mul_bf16_rounds_like_torch(isa, rows):
    native = _loaded(kernels.fused_ops, isa)
    torch.manual_seed(rows)
    x = (torch.randn(rows, 2 * 1536) * 6).bfloat16()  # far into both tails of the sigmoid
    x[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])
    out = native.silu_and_mul(x)
    assert out.dtype == torch.bfloat16
    _bf16_steps_apart(out, F.silu(x[:, :1536]) * x[:, 1536:], steps=1)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("rows", [1, 300])
def test_rms_norm_bf16_rounds_like_hf(isa, rows, threads, torch_threads):
    """HF's LlamaRMSNorm in bf16: float32 statistics and normalisation, the row rounded to bf16, then a
    bf16 product with the bf16 weight."""
    native = _loaded(kernels.fused_ops, isa)
    torch_threads(threads)
    torch.manual_seed(rows)
    x, w = (torch.randn(rows, 576) * 3).bfloat16(), torch.randn(576).bfloat16()
    h = x.float()
    ref = w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)).bfloat16()
    out = native.rms_norm(x, w, 1e-5)
    assert out.dtype == torch.bfloat16
    _bf16_steps_apart(out, ref, steps=2)


def test_bf16_layers_take_the_native_path():
    """RMSNorm and the gated MLP of a bf16 model run the native ops (same bits as calling them), within
    the stated bf16 steps of their torch ops."""
    native = kernels.fused_ops()
    if native is None:
        pytest.skip("no native kernels on this machine")
    torch.manual_seed(1)
    norm, mlp = RMSNorm(64, 1e-6, torch.bfloat16), GatedMLP(64, 96, bias=False, dtype=torch.bfloat16)
    with torch.no_grad():
        for p in [*norm.parameters(), *mlp.parameters()]:
            p.copy_(torch.randn(p.shape) * 0.2)
    x = torch.randn(5, 64).bfloat16()
    assert native_for(x) is native
    with torch.inference_mode():
        assert torch.equal(norm(x), native.rms_norm(x, norm.weight, 1e-6))
        h = x.float()
        _bf16_steps_apart(norm(x), norm.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).bfloat16(),
                          steps=2, min_equal=0.95)
        gate_up = mlp.gate_up_proj(x)
        assert torch.equal(mlp(x), mlp.down_proj(native.silu_and_mul(gate_up)))
