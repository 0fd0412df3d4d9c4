"""--quantization w8a8: per-channel int8 weights x per-token int8 activations against float references.

The layer's arithmetic is exact up to float rounding once its two roundings are applied (the weight's
per channel, the activations' per token), so each path is checked against that emulation at 1e-5 of
the largest output, and against the float layer within 2% (measured 0.8-1.1% on random layers). The int8
GEMM itself must be exact on every CPU: oneDNN's only where it has int8 dot products (`paths.w8a8_onednn`),
elsewhere the native kernel's or `torch._int_mm`'s.
"""
from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ecoserve.config import EngineArgs
from ecoserve.engine.llm import LLM
from ecoserve import kernels
from ecoserve.kernels import cpu, paths
from ecoserve.kernels.cpu import CpuCapabilities
from ecoserve.model import w8a8
from ecoserve.model.loader import load_model
from ecoserve.model.w8a8 import W8A8Linear, quantize_linears_w8a8, quantize_per_channel, quantize_per_token_torch
from tests.model.test_model_quant import LOGIT_TOL, _logits, greedy_with_margins
from tests.utils import make_tiny_checkpoint, prompts

K, N = 256, 96
PATHS = ["onednn-packed", "native", "int_mm-torch-ops"]
AVX2 = CpuCapabilities.from_flags({"avx2", "fma"})
VNNI = CpuCapabilities.from_flags({"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni"})


def _onednn_or_its_fallback(layer: W8A8Linear) -> W8A8Linear:
    """The oneDNN-packed layer where `paths.w8a8_onednn()` allows it. Elsewhere that path must not exist:
    `pack()` refuses and `quantize_linears_w8a8` leaves layers unpacked, and the fallback is what gets tested."""
    if paths.w8a8_onednn():
        layer.pack()
        return layer
    with pytest.raises(ValueError, match="W8A8Linear.pack: oneDNN's int8 GEMM is refused here"):
        layer.pack()
    assert not layer.packed and layer.weight.dtype == torch.int8
    model = nn.Sequential(nn.Linear(K, N))
    assert quantize_linears_w8a8(model) == 1 and isinstance(model[0], W8A8Linear) and not model[0].packed
    return layer


def _layer(path: str, bias: bool, monkeypatch) -> tuple[W8A8Linear, torch.nn.Linear]:
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
        layer = _onednn_or_its_fallback(layer)
    return layer, linear


def _adversarial(k: int, n: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """+/-127 weights, and activations spanning +/-127: rows equal to a weight row or its negation (every
    pair of products +/-2 x 127^2, the int32 sums at their largest), then uniform ones."""
    gen = torch.Generator().manual_seed(k)
    w = ((torch.randint(0, 2, (n, k), generator=gen) * 2 - 1) * 127).to(torch.int8)
    uniform = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
    uniform[:, :2] = torch.tensor([127, -127], dtype=torch.int8)
    return torch.cat([w, -w, uniform]), w


def test_per_channel_weights_round_to_half_a_step():
    w = torch.randn(N, K, generator=torch.Generator().manual_seed(0))
    q, scale = quantize_per_channel(w)
    assert q.dtype == torch.int8 and int(q.abs().max()) == 127
    err = (q.float() * scale[:, None] - w).abs()
    assert bool((err <= scale[:, None] * 0.5 + 1e-6).all())


@pytest.mark.skipif(w8a8._native() is None, reason="native quant_matmul kernel not built")
@pytest.mark.parametrize("isa", kernels.distinct_builds())
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
    assert isinstance(model.layers[1].mlp.down_proj, W8A8Linear) and not isinstance(model.lm_head, W8A8Linear)
    assert model.layers[0].self_attn.qkv_proj.packed == paths.w8a8_onednn()
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
    assert isinstance(model.layers[0].mlp.down_proj, W8A8Linear)
    assert model.layers[0].input_layernorm.weight.dtype == torch.bfloat16
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


@pytest.mark.parametrize("gemm", ["chosen", "int_mm"])
@pytest.mark.parametrize("k", [256, 4096])
def test_the_int8_gemm_is_exact_where_int16_pair_sums_would_saturate(k, gemm, monkeypatch):
    """The GEMM the engine runs here (and torch._int_mm, the fallback) on the worst case for int16 pair sums:
    its int32 sums equal the int64 reference (oneDNN's packed path, which returns float32: that reference
    rounded once to float32, the int32 sums converted)."""
    if gemm == "int_mm":
        monkeypatch.setattr(w8a8, "_native", lambda: None)
    xq, wq = _adversarial(k)
    layer = W8A8Linear(k, wq.shape[0])
    layer.weight = nn.Parameter(wq, requires_grad=False)
    layer.weight_scale = nn.Parameter(torch.ones(wq.shape[0]), requires_grad=False)
    if gemm == "chosen" and paths.w8a8_onednn():
        layer.pack()
    out, ref = layer.gemm(xq), xq.long() @ wq.long().T
    assert int(ref.abs().max()) == 127 * 127 * k  # the largest sums are there
    if layer.packed:
        assert out.dtype == torch.float32 and torch.equal(out, ref.float())
    else:
        assert out.dtype == torch.int32 and torch.equal(out.long(), ref)


@pytest.mark.skipif(w8a8._native() is None, reason="native quant_matmul kernel not built")
def test_the_native_int8_gemm_names_what_it_cannot_take():
    native, w = w8a8._native(), torch.zeros(3, K, dtype=torch.int8)
    with pytest.raises(RuntimeError, match="int8_gemm: x must lie within"):
        native.int8_gemm(torch.full((2, K), -128, dtype=torch.int8), w)
    with pytest.raises(RuntimeError, match="int8_gemm: x .M, K. and w .N, K. must be 2-D int8"):
        native.int8_gemm(torch.zeros(2, K + 1, dtype=torch.int8), w)
    assert torch.equal(native.int8_gemm(torch.zeros(0, K, dtype=torch.int8), w), torch.zeros(0, 3, dtype=torch.int32))


def test_the_oneDNN_decision_follows_the_capabilities(monkeypatch, caplog):
    """Described CPUs (decisions only: oneDNN's packed GEMM is not run under a faked VNNI): an AVX2 one packs
    nothing, and says so once; one with VNNI or AMX-INT8 takes oneDNN's int8 GEMM where torch has oneDNN."""
    assert not paths.w8a8_onednn(AVX2) and paths.w8a8_onednn(VNNI)
    assert paths.w8a8_onednn(CpuCapabilities.from_flags({"avx2", "fma", "avx_vnni"}))
    assert not paths.w8a8_onednn(CpuCapabilities.from_flags(VNNI.flags, onednn=False))
    monkeypatch.setattr(cpu, "capabilities", lambda: AVX2)
    model = nn.Sequential(nn.Linear(K, N), nn.Linear(N, K))
    with caplog.at_level(logging.INFO, logger=w8a8.__name__):
        assert quantize_linears_w8a8(model) == 2
    assert not any(layer.packed for layer in model)
    lines = [r for r in caplog.records if r.name == w8a8.__name__]
    assert len(lines) == 1 and lines[0].levelno == logging.INFO and "exact" in lines[0].getMessage()
    assert "no int8 dot-product instructions" in lines[0].getMessage()
    with pytest.raises(ValueError, match="no int8 dot-product instructions"):
        model[0].pack()
    monkeypatch.setattr(cpu, "capabilities", lambda: VNNI)
    assert paths.w8a8_onednn()


def test_the_lm_head_stays_float_unless_asked(tmp_path):
    """Float by default, as vLLM's W8A8 keeps it (a tied one keeps reading the embedding, as the float model's
    does); int8 with quantize_lm_head, tied or not (the embedding stays float), by the loader and by LLM."""
    for tied in (False, True):
        ckpt = make_tiny_checkpoint(tmp_path / f"ckpt-{tied}", "llama", tie_word_embeddings=tied)
        default, reference = load_model(str(ckpt), quantization="w8a8").model, load_model(str(ckpt)).model
        assert not isinstance(default.lm_head, W8A8Linear) and type(default.lm_head) is type(reference.lm_head)
        hidden = torch.randn(4, reference.spec.hidden_size)
        assert torch.equal(default.compute_logits(hidden), reference.compute_logits(hidden))  # the same float head
        asked = load_model(str(ckpt), quantization="w8a8", quantize_lm_head=True).model
        assert isinstance(asked.lm_head, W8A8Linear) and asked.embed_tokens.weight.dtype == torch.float32
        ids = prompts(1, seed=3, min_len=6, max_len=6)[0]
        ours, ref = _logits(asked, ids), _logits(reference, ids)
        assert (ours - ref).abs().max().item() <= LOGIT_TOL * ref.abs().max().item()
    engine = LLM(str(ckpt), quantization="w8a8", quantize_lm_head=True, num_gpu_blocks=16, max_model_len=64).llm_engine
    assert engine.config.quantize_lm_head and isinstance(engine.loaded.model.lm_head, W8A8Linear)
    engine = LLM(str(ckpt), quantization="w8a8", num_gpu_blocks=16, max_model_len=64).llm_engine
    assert not isinstance(engine.loaded.model.lm_head, W8A8Linear)


@pytest.mark.parametrize("quantization", [None, "none", "int8", "gguf"])
def test_quantize_lm_head_needs_w8a8(quantization):
    """Refused by the config validation and by the loader, before anything is read (no such model exists)."""
    with pytest.raises(ValueError, match="quantize_lm_head .--quantize-lm-head. needs quantization w8a8"):
        EngineArgs(quantization=quantization, quantize_lm_head=True).create_engine_config()
    with pytest.raises(ValueError, match="needs quantization w8a8"):
        LLM("no-such-model", quantization=quantization, quantize_lm_head=True)
    if quantization != "gguf":  # the loader refuses gguf of a non-GGUF model first
        with pytest.raises(ValueError, match="needs quantization w8a8"):
            load_model("no-such-model", quantization=quantization, quantize_lm_head=True)
    assert EngineArgs(quantization="w8a8", quantize_lm_head=True).create_engine_config().quantize_lm_head
