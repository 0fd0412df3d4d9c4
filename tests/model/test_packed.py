"""--cpu-linear onednn / auto (the default): prepacked oneDNN linears against torch's F.linear, layer and whole model."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ecoserve.model.loader import load_model
from ecoserve.model.packed import PackedLinear, onednn_available
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
