"""The native grouped expert kernel (kernels/moe_experts.cpp) against the per-expert torch path
(model/moe.py's `fused_experts` on plain stacked weights), on this CPU's build and the AVX2-only one."""
import pytest
import torch

from ecoserve import kernels
from ecoserve.model import packed as packed_module
from ecoserve.model.moe import fused_experts
from ecoserve.model.packed import NativeExperts, PackedExperts, pack_moe_experts, packable_dtypes

ISAS = kernels.distinct_builds()  # avx2 too where that build differs from this CPU's
DTYPES = [torch.float32, torch.bfloat16]


def kernel(isa: str, dtype: torch.dtype):
    module = kernels.moe_experts(isa)
    if module is None:
        pytest.skip(f"no native moe_experts kernel for {isa} on this machine (compiler or CPU)")
    if not module.supports(dtype):
        pytest.skip(f"no brgemm micro-kernel for {dtype} on this CPU")
    return module


def experts(E: int, H: int, I: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return ((0.1 * torch.randn(E, 2 * I, H, generator=g)).to(dtype),
            (0.1 * torch.randn(E, H, I, generator=g)).to(dtype))


def pack(module, w_gate_up, w_down):
    inter = w_down.shape[2]
    gate, up = (w.contiguous() for w in w_gate_up.split(inter, dim=1))
    return torch.cat([module.pack_experts(gate), module.pack_experts(up)], dim=1), module.pack_experts(w_down)


def close(got, want, dtype):
    """float32 within reassociation of the GEMM sums; bfloat16 within one bf16 step of the output's scale
    (a GEMM output on a rounding boundary can round the other way)."""
    scale = float(want.abs().max()) or 1.0
    tol = 1e-5 if dtype == torch.float32 else 8e-3
    torch.testing.assert_close(got, want, rtol=0, atol=tol * scale)


# (tokens, experts, top_k, hidden, intermediate, routing): "random" softmax top-k, "one-hot" sends every
# token to expert 0 first (it gets all rows, most experts none), "single" one token
CASES = [(1, 8, 1, 64, 32, "random"), (1, 8, 8, 96, 64, "random"), (5, 8, 2, 81, 47, "random"),
         (40, 16, 2, 80, 48, "one-hot"), (70, 12, 8, 100, 36, "random"), (9, 8, 3, 130, 100, "random"),
         (3, 64, 8, 768, 256, "random"), (200, 4, 2, 64, 64, "one-hot")]


def routing(T, E, k, kind, seed=1):
    g = torch.Generator().manual_seed(seed)
    weights, ids = torch.softmax(torch.randn(T, E, generator=g), -1).topk(k, dim=-1)
    if kind == "one-hot":
        ids = torch.stack([torch.arange(k) for _ in range(T)])  # expert 0 all rows, experts >= k none
    return weights, ids


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES)
def test_kernel_equals_the_per_expert_path(isa, dtype, case):
    T, E, k, H, I, kind = case
    module = kernel(isa, dtype)
    w_gate_up, w_down = experts(E, H, I, dtype)
    gate_up, down = pack(module, w_gate_up, w_down)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(2)).to(dtype)
    weights, ids = routing(T, E, k, kind)
    want = fused_experts(x, ids, weights, w_gate_up, w_down)
    outs, before = [], torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            outs.append(module.moe_experts(x, ids, weights, gate_up, down, I, 0))
    finally:
        torch.set_num_threads(before)
    assert outs[0].dtype == dtype and outs[0].shape == (T, H)
    close(outs[0], want, dtype)
    assert torch.equal(outs[0], outs[1])  # no atomics: the thread count does not change a bit


@pytest.mark.parametrize("dtype", DTYPES)
def test_routing_weights_in_the_model_dtype_and_expert_parallel_slices(dtype):
    """Weights in x's dtype (Qwen's routers) round like the per-expert path; experts [first, first + E)
    of a slice take only their own pairs, so two halves add up to the whole and a slice nobody routed to is zero."""
    module = kernel("native", dtype)
    T, E, k, H, I = 9, 8, 2, 64, 48
    w_gate_up, w_down = experts(E, H, I, dtype)
    x = torch.randn(T, H).to(dtype)
    weights, ids = routing(T, E, k, "random")
    weights = weights.to(dtype)
    whole = module.moe_experts(x, ids, weights, *pack(module, w_gate_up, w_down), I, 0)
    close(whole, fused_experts(x, ids, weights, w_gate_up, w_down), dtype)
    halves = [module.moe_experts(x, ids, weights, *pack(module, w_gate_up[r * 4:(r + 1) * 4],
                                                        w_down[r * 4:(r + 1) * 4]), I, r * 4) for r in range(2)]
    for r in range(2):
        close(halves[r], fused_experts(x, ids, weights, w_gate_up[r * 4:(r + 1) * 4], w_down[r * 4:(r + 1) * 4], r * 4),
              dtype)
    close(halves[0].float() + halves[1].float(), whole.float(), dtype)
    empty = module.moe_experts(x[:0], ids[:0], weights[:0], *pack(module, w_gate_up, w_down), I, 0)
    assert empty.shape == (0, H) and empty.dtype == dtype
    elsewhere = torch.full((T, k), 7)
    assert module.moe_experts(x, elsewhere, weights, *pack(module, w_gate_up[:4], w_down[:4]), I, 0).abs().max() == 0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(3, 64, 32), (2, 47, 81), (1, 33, 17)])
def test_pack_and_unpack_round_trip_bit_for_bit(dtype, shape):
    module = kernel("native", dtype)
    w = torch.randn(shape).to(dtype)
    w[0, 0, :3] = torch.tensor([-0.0, float("inf"), 1e-30])
    packed = module.pack_experts(w)
    assert packed.shape[0] == shape[0] and packed.numel() >= w.numel()  # whole column blocks, zero-padded
    assert torch.equal(module.unpack_experts(packed, shape[1], shape[2]).view(torch.int16 if dtype == torch.bfloat16
                                                                               else torch.int32),
                       w.view(torch.int16 if dtype == torch.bfloat16 else torch.int32))


def test_bad_inputs_are_clear_errors():
    module = kernel("native", torch.float32)
    w_gate_up, w_down = experts(4, 32, 16, torch.float32)
    gate_up, down = pack(module, w_gate_up, w_down)
    x, weights, ids = torch.randn(3, 32), torch.rand(3, 2), torch.tensor([[0, 1], [2, 3], [1, 0]])
    with pytest.raises(RuntimeError, match="ids must be int64"):
        module.moe_experts(x, ids.int(), weights, gate_up, down, 16, 0)
    with pytest.raises(RuntimeError, match="weights must be floating"):
        module.moe_experts(x, ids, weights[:, :1], gate_up, down, 16, 0)
    with pytest.raises(RuntimeError, match="in x's dtype"):
        module.moe_experts(x.bfloat16(), ids, weights, gate_up, down, 16, 0)
    with pytest.raises(RuntimeError, match="is not"):
        module.moe_experts(x, ids, weights, gate_up, down, 24, 0)
    with pytest.raises(RuntimeError, match="is not"):
        module.moe_experts(torch.randn(3, 64), ids, weights, gate_up, down, 16, 0)
    with pytest.raises(RuntimeError, match="was not packed"):
        module.unpack_experts(down, 32, 15)


@torch.inference_mode()
@pytest.mark.parametrize("dtype", DTYPES)
def test_native_experts_module_and_the_fallback_without_the_kernel(dtype, monkeypatch):
    """pack_moe_experts packs for the kernel where it runs the dtype; without it (ECOSERVE_NO_NATIVE=1, no
    compiler) bfloat16 experts take the per-expert oneDNN path and float32 ones stay plain, as before."""
    from ecoserve.model.moe import SparseMoeBlock
    from ecoserve.model.spec import MoESpec

    moe = MoESpec(num_experts=6, top_k=2, intermediate_size=40, norm_topk_prob=True, weights_in_model_dtype=True)
    block = SparseMoeBlock(56, moe, dtype)
    for p in block.parameters():
        p.copy_(0.1 * torch.randn(p.shape))
    plain_gate_up, plain_down = block.w_gate_up.data.clone(), block.w_down.data.clone()
    x = torch.randn(7, 56).to(dtype)
    want = block(x)
    if NativeExperts.supports(dtype):  # elsewhere only the fallback below exists
        assert pack_moe_experts(block) == 1 and isinstance(block.packed_experts, NativeExperts)
        close(block(x), want, dtype)
        block.unpack_experts()
        assert torch.equal(block.w_gate_up, plain_gate_up) and torch.equal(block.w_down, plain_down)

    monkeypatch.setattr(kernels, "moe_experts", lambda isa=None: None)
    monkeypatch.setattr(packed_module, "moe_experts", lambda isa=None: None)
    assert not NativeExperts.supports(dtype)
    packs = dtype in packable_dtypes() - {torch.float32}
    assert pack_moe_experts(block) == int(packs)
    assert isinstance(block.packed_experts, PackedExperts) if packs else block.packed_experts is None
    close(block(x), want, dtype)
