"""--cpu-linear onednn / auto (the default): prepacked oneDNN linears against torch's F.linear, layer and whole model,
in float32 and bfloat16 (natively where oneDNN supports it, else on the widened weight)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ecoserve.model.loader import load_model
from ecoserve.model.packed import PackedLinear, onednn_available
from ecoserve.kernels.paths import onednn_linear
from tests.utils import DenseCausalAttention, dense_greedy, make_tiny_checkpoint, prompts

pytestmark = pytest.mark.skipif(not onednn_available(), reason="torch built without oneDNN")


@pytest.mark.parametrize("rows", [1, 5, 200])
def test_packed_linear_matches_f_linear(rows):
    g = torch.Generator().manual_seed(rows)
    w, b, x = torch.randn(96, 64, generator=g), torch.randn(96, generator=g), torch.randn(2, rows, 64, generator=g)
    out = PackedLinear(w, b)(x)
    assert out.shape == (2, rows, 96) and torch.allclose(out, F.linear(x, w, b), atol=1e-4, rtol=1e-5)


def test_packed_model_matches_the_plain_one(tmp_path):
    ckpt = make_tiny_checkpoint(tmp_path / "ckpt", "llama")
    packed, plain = load_model(str(ckpt), cpu_linear="onednn").model, load_model(str(ckpt), cpu_linear="torch").model
    assert isinstance(packed.layers[0].mlp.down_proj, PackedLinear) and isinstance(packed.lm_head, PackedLinear)
    ids = prompts(1, seed=3)[0]
    with torch.no_grad():
        a = packed.compute_logits(packed(torch.tensor(ids), torch.arange(len(ids)), DenseCausalAttention()))
        b = plain.compute_logits(plain(torch.tensor(ids), torch.arange(len(ids)), DenseCausalAttention()))
    assert (a - b).abs().max().item() < 1e-4
    assert dense_greedy(packed, ids, 12) == dense_greedy(plain, ids, 12)


def test_packing_is_single_process_only(tmp_path):
    with pytest.raises(ValueError, match="single-process"):
        load_model(str(make_tiny_checkpoint(tmp_path / "ckpt", "llama")), cpu_linear="onednn", weights=False)


def test_auto_packs_a_whole_model_and_torch_keeps_f_linear(tmp_path):
    ckpt = str(make_tiny_checkpoint(tmp_path / "ckpt", "llama"))
    assert isinstance(load_model(ckpt).model.layers[0].self_attn.qkv_proj, PackedLinear)  # the default: auto
    assert not any(isinstance(m, PackedLinear) for m in load_model(ckpt, cpu_linear="torch").model.modules())
    assert load_model(ckpt, weights=False).model is None  # auto under TP/PP: the ranks keep F.linear, no error


BF16_PACKED = torch.bfloat16 if onednn_linear(torch.bfloat16) else torch.float32  # else widened


@pytest.mark.parametrize("rows", [1, 5, 200])
def test_packed_bf16_linear_matches_f_linear(rows):
    """Both accumulate in float32 and round the output once: equal within one bf16 rounding of the output."""
    g = torch.Generator().manual_seed(rows)
    w, b = torch.randn(96, 256, generator=g).bfloat16(), torch.randn(96, generator=g).bfloat16()
    x = torch.randn(rows, 256, generator=g).bfloat16()
    out = PackedLinear(w, b)(x)
    ref = F.linear(x.float(), w.float(), b.float())  # the exact products, summed in float32
    assert out.dtype == torch.bfloat16 and out.shape == (rows, 96)
    assert torch.allclose(out.float(), ref, atol=1e-2, rtol=2 ** -7)  # bf16: 8 mantissa bits
    assert torch.allclose(out.float(), F.linear(x, w, b).float(), atol=1e-2, rtol=2 ** -7)


def test_bf16_model_packs_every_linear_and_the_tied_head(tmp_path):
    ckpt = make_tiny_checkpoint(tmp_path / "ckpt", "qwen2", tie_word_embeddings=True)
    packed = load_model(str(ckpt), dtype="bfloat16").model  # auto
    plain = load_model(str(ckpt), dtype="bfloat16", cpu_linear="torch").model
    layers = [m for m in packed.modules() if isinstance(m, PackedLinear)]
    assert len(layers) == 2 * 4 + 1 and all(m.packed.dtype == BF16_PACKED for m in layers)  # qkv, o, gate_up, down
    assert isinstance(packed.lm_head, PackedLinear) and packed.embed_tokens.weight.dtype == torch.bfloat16
    ids = prompts(1, seed=4)[0]
    with torch.no_grad():
        a = packed.compute_logits(packed(torch.tensor(ids), torch.arange(len(ids)), DenseCausalAttention()))
        b = plain.compute_logits(plain(torch.tensor(ids), torch.arange(len(ids)), DenseCausalAttention()))
    assert a.dtype == b.dtype == torch.float32
    assert (a - b).abs().max().item() < 0.25  # bf16 rounding of the logits (|logit| < 16: ulp 0.0625)


def test_bf16_layers_are_packed_widened_where_onednn_has_no_bf16(monkeypatch):
    """Where oneDNN would refuse or emulate bf16, the weight is packed as float32 (widened exactly): the output is
    the exact products summed in float32, rounded once to bf16, as a bf16 GEMM gives it."""
    from dataclasses import replace

    from ecoserve.kernels import cpu

    no_bf16 = replace(cpu.capabilities(), onednn_bf16=False)
    monkeypatch.setattr(cpu, "capabilities", lambda: no_bf16)
    g = torch.Generator().manual_seed(7)
    w, b = torch.randn(96, 256, generator=g).bfloat16(), torch.randn(96, generator=g).bfloat16()
    layer = PackedLinear(w, b)
    assert layer.packed.dtype == torch.float32 and "widened" in repr(layer)
    for rows in (1, 5, 200):  # the decode rows' native loop and oneDNN's GEMM
        x = torch.randn(rows, 256, generator=g).bfloat16()
        out = layer(x)
        ref = F.linear(x.float(), w.float(), b.float())
        assert out.dtype == torch.bfloat16 and torch.allclose(out.float(), ref, atol=1e-5, rtol=2 ** -8)
