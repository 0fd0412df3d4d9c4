"""The native fused elementwise ops against the torch ops they replace (ecoserve/model/fused.py)."""
import pytest
import torch
import torch.nn.functional as F

from ecoserve.kernels import fused_ops
from ecoserve.model.layers import GatedMLP, RMSNorm
from ecoserve.model.rope import apply_rotary

native = fused_ops()
pytestmark = pytest.mark.skipif(native is None, reason="no native kernels on this machine")


def torch_rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("rows", [1, 7, 300])
def test_rms_norm(rows, threads, torch_threads):
    torch_threads(threads)
    torch.manual_seed(rows)
    x, w = torch.randn(rows, 576), torch.randn(576)
    torch.testing.assert_close(native.rms_norm(x, w, 1e-5), torch_rms(x, w, 1e-5), rtol=2e-6, atol=2e-6)


def test_rotary_in_place_on_the_qkv_output_is_bit_equal():
    """q and k are side by side in each row of the fused qkv output: one in-place pass rotates both
    with the same bits as the torch ops, and v is untouched."""
    torch.manual_seed(0)
    T, H, Hkv, D = 9, 6, 2, 64
    qkv = torch.randn(T, (H + 2 * Hkv) * D)
    cos, sin = torch.randn(T, 1, D // 2), torch.randn(T, 1, D // 2)
    q, k, v = (t.reshape(T, -1, D) for t in qkv.split([H * D, Hkv * D, Hkv * D], dim=-1))
    ref_q, ref_k, v_before = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v.clone()
    native.rotary_(qkv[:, :(H + Hkv) * D].view(T, -1, D), cos, sin)
    q, k, v = (t.reshape(T, -1, D) for t in qkv.split([H * D, Hkv * D, Hkv * D], dim=-1))
    assert torch.equal(q, ref_q) and torch.equal(k, ref_k) and torch.equal(v, v_before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, 2])
def test_head_norm_in_place_on_the_qkv_output_equals_rms_norm_per_head(dtype, threads, torch_threads):
    """Qwen3's q and k norms inside the fused qkv output: each head's row gets the same bits as rms_norm
    gives that row alone (itself checked against torch and HF above and in test_kernels_bf16.py); the other
    part of the row and v are untouched."""
    torch_threads(threads)
    torch.manual_seed(2)
    T, H, Hkv, D = 33, 6, 2, 64
    qkv = (torch.randn(T, (H + 2 * Hkv) * D) * 3).to(dtype)
    wq, wk = torch.randn(D).to(dtype), torch.randn(D).to(dtype)
    q, k, v = qkv.split([H * D, Hkv * D, Hkv * D], dim=-1)
    ref_q = native.rms_norm(q.reshape(T * H, D).contiguous(), wq, 1e-6).view(T, H * D)
    k_before, v_before = k.clone(), v.clone()
    native.head_rms_norm_(q.view(T, H, D), wq, 1e-6)
    assert torch.equal(q, ref_q) and torch.equal(k, k_before) and torch.equal(v, v_before)
    native.head_rms_norm_(k.view(T, Hkv, D), wk, 1e-6)
    assert torch.equal(k, native.rms_norm(k_before.reshape(T * Hkv, D).contiguous(), wk, 1e-6).view(T, Hkv * D))
    assert torch.equal(v, v_before)
    with pytest.raises(RuntimeError, match="contiguous heads"):
        native.head_rms_norm_(torch.randn(3, 8, 2).to(dtype).transpose(1, 2), wq[:8], 1e-6)
    with pytest.raises(RuntimeError, match="must be \\[D\\]"):
        native.head_rms_norm_(torch.randn(3, 2, 8).to(dtype), wq, 1e-6)


@pytest.mark.parametrize("rows", [1, 2048])
def test_silu_and_mul(rows):
    torch.manual_seed(rows)
    x = torch.randn(rows, 2 * 1536) * 6  # far into both tails of the sigmoid
    x[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])
    ref = F.silu(x[:, :1536]) * x[:, 1536:]
    torch.testing.assert_close(native.silu_and_mul(x), ref, rtol=1e-6, atol=1e-6)


def test_layers_take_the_native_path_only_where_it_applies():
    """float32 CPU rows go native (same values as torch's ops); a non-contiguous input and float64
    take the torch ops and still agree."""
    torch.manual_seed(1)
    norm, mlp = RMSNorm(64, 1e-6), GatedMLP(64, 96, bias=False)
    x = torch.randn(5, 64)
    with torch.inference_mode():
        torch.testing.assert_close(norm(x), torch_rms(x, norm.weight, 1e-6), rtol=2e-6, atol=2e-6)
        gate, up = mlp.gate_up_proj(x).split(96, dim=-1)
        ref = mlp.down_proj(F.silu(gate) * up)  # SiLU's exponential is within 2e-7: compare at the output's scale
        torch.testing.assert_close(mlp(x), ref, rtol=0, atol=1e-5 * float(ref.abs().max()))
        strided = torch.randn(64, 5).t()
        torch.testing.assert_close(norm(strided), torch_rms(strided, norm.weight, 1e-6), rtol=2e-6, atol=2e-6)
        x64 = x.double()
        torch.testing.assert_close(RMSNorm(64, 1e-6, torch.float64)(x64), torch_rms(x64, torch.ones(64).double(),
                                                                                    1e-6))


def test_fused_ops_reject_mismatched_shapes():
    with pytest.raises(RuntimeError, match="cos/sin must be"):
        native.rotary_(torch.randn(3, 2, 8), torch.randn(3, 1, 3), torch.randn(3, 1, 3))
    with pytest.raises(RuntimeError, match="contiguous heads"):
        native.rotary_(torch.randn(3, 8, 2).transpose(1, 2), torch.randn(3, 1, 4), torch.randn(3, 1, 4))
    with pytest.raises(RuntimeError, match="the weight must have the rows' length"):
        native.rms_norm(torch.randn(2, 8), torch.randn(7), 1e-6)
    with pytest.raises(RuntimeError, match="float32 or bfloat16 only"):
        native.silu_and_mul(torch.randn(2, 8).double())
    with pytest.raises(RuntimeError, match="rows and weight alike"):  # a bf16 row never meets a float32 weight
        native.rms_norm(torch.randn(2, 8).bfloat16(), torch.randn(8), 1e-6)
    with pytest.raises(RuntimeError, match="x, cos and sin must be float32 or bfloat16 alike"):
        native.rotary_(torch.randn(3, 2, 8).bfloat16(), torch.randn(3, 1, 4), torch.randn(3, 1, 4))
