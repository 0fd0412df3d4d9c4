"""--quantization w8a8: per-channel int8 weights x per-token int8 activations against float references.

The layer's arithmetic is exact up to float rounding once its two roundings are applied (the weight's
per channel, the activations' per token), so each path is checked against that emulation at 1e-5 of
the largest output, and against the float layer within 2% (measured 0.8-1.1% on random layers).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ecoserve.model import w8a8
from ecoserve.model.loader import load_model
from ecoserve.model.packed import onednn_available
from ecoserve.model.w8a8 import W8A8Linear, quantize_per_channel, quantize_per_token_torch
from tests.model.test_model_quant import LOGIT_TOL, _logits, greedy_with_margins
from tests.utils import make_tiny_checkpoint, prompts

K, N = 256, 96
PATHS = ["onednn-packed", "int_mm", "int_mm-torch-ops"]


def _layer(path: str, bias: bool, monkeypatch) -> tuple[W8A8Linear, torch.nn.Linear]:
    if path == "onednn-packed" and not onednn_available():
        pytest.skip("torch has no oneDNN")
    if path == "int_mm-torch-ops":
        monkeypatch.setattr(w8a8, "_native", lambda: None)
    elif w8a8._native() is None:
        pytest.skip("native quant_matmul kernel not built")
    linear = torch.nn.Linear(K, N, bias=bias)
    torch.nn.init.normal_(linear.weight, generator=torch.Generator().manual_seed(1))
    if bias:
        torch.nn.init.normal_(linear.bias, generator=torch.Generator().manual_seed(2))
    layer = W8A8Linear.from_linear(linear)
    if path == "onednn-packed":
        layer.pack()
    return layer, linear


def test_per_channel_weights_round_to_half_a_step():
    w = torch.randn(N, K, generator=torch.Generator().manual_seed(0))
    q, scale = quantize_per_channel(w)
    assert q.dtype == torch.int8 and int(q.abs().max()) == 127
    err = (q.float() * scale[:, None] - w).abs()
    assert bool((err <= scale[:, None] * 0.5 + 1e-6).all())


@pytest.mark.skipif(w8a8._native() is None, reason="native quant_matmul kernel not built")
@pytest.mark.parametrize("isa", ["native", "avx2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k", [K, K + 5])
def test_native_per_token_rounding_equals_torch(k, dtype, isa):
    """Bit-equal to torch's rounding on the AVX-512 build and on the AVX2 one (scalar loops under -ffast-math)."""
    from ecoserve.kernels import quant_matmul

    kernel = quant_matmul(isa)
    if kernel is None:
        pytest.skip(f"no {isa} build of quant_matmul on this machine")
    x = (torch.randn(7, k, generator=torch.Generator().manual_seed(4)) * torch.arange(1, 8)[:, None]).to(dtype)
    x[3] = 0  # an all-zero row: scale 0, no division by it
    q, scale = kernel.quantize_per_token(x)
    q_ref, scale_ref = quantize_per_token_torch(x.float())
    assert torch.equal(q, q_ref) and torch.equal(scale, scale_ref)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("rows", [1, 5, 64])
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_w8a8_linear_matches_its_emulation_and_the_float_layer(path, rows, bias, monkeypatch):
    layer, linear = _layer(path, bias, monkeypatch)
    x = torch.randn(2, rows, K, generator=torch.Generator().manual_seed(rows))
    out = layer(x)
    assert out.shape == (2, rows, N) and out.dtype == torch.float32
    # the same two roundings in float64: what the int8 GEMM computes exactly
    xq, x_scale = quantize_per_token_torch(x.reshape(-1, K))
    wq, w_scale = quantize_per_channel(linear.weight.data)
    emulated = (xq.double() @ wq.double().T) * x_scale.double()[:, None] * w_scale.double()
    if bias:
        emulated += linear.bias.data.double()
    emulated = emulated.reshape(2, rows, N).float()
    assert (out - emulated).abs().max().item() <= 1e-5 * emulated.abs().max().item()
    exact = F.linear(x, linear.weight.data, linear.bias.data if bias else None)
    assert (out - exact).abs().max().item() <= 2e-2 * exact.abs().max().item()


def test_w8a8_quantizes_every_linear_and_stays_near_the_float_model(tmp_path):
    ckpt = make_tiny_checkpoint(tmp_path / "ckpt", "llama")
    model, reference = load_model(str(ckpt), quantization="w8a8").model, load_model(str(ckpt)).model
    assert isinstance(model.layers[0].self_attn.qkv_proj, W8A8Linear)
    assert isinstance(model.layers[1].mlp.down_proj, W8A8Linear) and isinstance(model.lm_head, W8A8Linear)
    assert model.layers[0].self_attn.qkv_proj.packed == onednn_available()
    for length in (5, 40):  # a decode-sized and a prefill-sized batch of rows
        ids = prompts(1, seed=9, min_len=length, max_len=length)[0]
        ours, ref = _logits(model, ids), _logits(reference, ids)
        assert (ours - ref).abs().max().item() <= LOGIT_TOL * ref.abs().max().item()


def test_w8a8_greedy_tokens_equal_the_float_model_except_near_ties(tmp_path):
    ckpt = make_tiny_checkpoint(tmp_path / "ckpt", "llama")
    model, reference = load_model(str(ckpt), quantization="w8a8").model, load_model(str(ckpt)).model
    # the tiny random model's logits are nearly flat, so near-ties are common: on these prompts the
    # tokens part at steps 1, 1 and 5 (top-two margins 0.6-1.7% of the largest logit) or never
    for ids in prompts(4, seed=13):
        ours, ref, margin = greedy_with_margins(model, reference, ids[:8], 12)
        assert ours[0] == ref[0] or margin < LOGIT_TOL / 2, f"first token differs at a margin of {margin:.3f}"
        assert ours == ref or margin < 2 * LOGIT_TOL, f"parted at a margin of {margin:.3f}: {ours} vs {ref}"


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_bfloat16_rows_give_the_float32_result_rounded_once(path, bias, monkeypatch):
    """bfloat16 activations go through the same int8 GEMM: the float32 result for the same values, rounded
    once to bfloat16 (the per-token scaling and bias stay float32)."""
    layer, _ = _layer(path, bias, monkeypatch)
    x = torch.randn(9, K, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    out = layer(x)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, layer(x.float()).to(torch.bfloat16))


@pytest.mark.skipif(w8a8._native() is None, reason="native quant_matmul kernel not built")
def test_native_passes_name_what_they_cannot_take():
    native, out, scale = w8a8._native(), torch.zeros(3, N), torch.ones(3)
    with pytest.raises(RuntimeError, match="quantize_per_token: x must be 2-D float32 or bfloat16"):
        native.quantize_per_token(torch.zeros(3, K, dtype=torch.float16))
    with pytest.raises(RuntimeError, match="scale_rows_to: dst"):
        native.scale_rows_to(out, scale, None, torch.zeros(3, N, dtype=torch.float16))
    with pytest.raises(RuntimeError, match="scale_rows_to: dst"):
        native.scale_rows_to(out, scale, None, torch.zeros(3, N + 1))
    with pytest.raises(RuntimeError, match="scale_rows_to: x_scale"):
        native.scale_rows_to(out, torch.ones(2), None, out)


def test_w8a8_runs_bfloat16_activations_and_nothing_else_but_float32(tmp_path):
    ckpt = make_tiny_checkpoint(tmp_path / "ckpt", "llama")
    model = load_model(str(ckpt), quantization="w8a8", dtype="bfloat16").model
    assert isinstance(model.lm_head, W8A8Linear) and model.layers[0].input_layernorm.weight.dtype == torch.bfloat16
    ids = prompts(1, seed=9, min_len=20, max_len=20)[0]
    ref = _logits(load_model(str(ckpt)).model, ids)
    # within the int8 roundings' tolerance plus what bfloat16 alone moves the float model's logits
    bf16_error = (_logits(load_model(str(ckpt), dtype="bfloat16").model, ids).float() - ref).abs().max().item()
    ours = _logits(model, ids).float()
    assert (ours - ref).abs().max().item() <= LOGIT_TOL * ref.abs().max().item() + bf16_error
    with pytest.raises(ValueError, match="float32 activations"):
        load_model(str(ckpt), quantization="w8a8", dtype="float16")
    with pytest.raises(ValueError, match="float32 activations"):
        load_model(str(ckpt), quantization="int8", dtype="bfloat16")
