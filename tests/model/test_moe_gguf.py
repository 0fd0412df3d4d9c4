"""Mixture-of-experts GGUF files (llama.cpp's layout: stacked ffn_*_exps, router ffn_gate_inp, shared expert
*_shexp) written with the gguf library from tiny checkpoints load and match HF transformers."""
from __future__ import annotations

import pytest
import torch

from ecoserve.model.gguf import convert_gguf, hf_tensor_name
from ecoserve.model.loader import load_model
from ecoserve.model.moe import SparseMoeBlock
from tests.utils import DenseCausalAttention, hf_greedy, hf_logits, make_tiny_gguf, make_tiny_moe_checkpoint, prompts


def test_expert_tensor_names():
    assert hf_tensor_name("blk.2.ffn_gate_inp.weight") == "model.layers.2.mlp.gate.weight"
    assert hf_tensor_name("blk.0.ffn_down_exps.weight") == "model.layers.0.mlp.experts.down_proj.weight"
    assert hf_tensor_name("blk.1.ffn_gate_inp_shexp.weight") == "model.layers.1.mlp.shared_expert_gate.weight"


@pytest.mark.parametrize("arch,overrides", [
    ("mixtral", {}),
    ("qwen2_moe", {}),
    ("qwen3_moe", dict(mlp_only_layers=[], num_hidden_layers=2)),  # llama.cpp's qwen3moe has no dense layers
])
def test_moe_gguf_matches_hf(tmp_path, arch, overrides):
    ckpt = make_tiny_moe_checkpoint(tmp_path / "ckpt", arch, **overrides)
    out = convert_gguf(make_tiny_gguf(ckpt, tmp_path / "tiny.gguf"), tmp_path / "converted")
    model = load_model(str(out)).model
    assert all(isinstance(layer.mlp, SparseMoeBlock) for layer in model.layers)
    ids = prompts(1, seed=6, min_len=24, max_len=24)[0]
    with torch.no_grad():
        ours = model.compute_logits(model(torch.tensor(ids), torch.arange(len(ids)), DenseCausalAttention()))
    assert (ours - hf_logits(ckpt, ids)).abs().max().item() < 1e-4
    from tests.utils import dense_greedy

    assert dense_greedy(model, ids, 8) == hf_greedy(ckpt, ids, 8, ignore_eos=True)


def test_quantized_moe_gguf_keeps_experts_float(tmp_path):
    """--quantization gguf keeps attention blocks quantized; the experts (dequantized) still route and compute."""
    from gguf import GGMLQuantizationType

    ckpt = make_tiny_moe_checkpoint(tmp_path / "ckpt", "qwen2_moe", shared_expert_intermediate_size=64)  # Q8_0 rows: 32k
    path = make_tiny_gguf(ckpt, tmp_path / "q8.gguf", GGMLQuantizationType.Q8_0)
    loaded = load_model(str(path), quantization="gguf")
    block = loaded.model.layers[0].mlp
    assert isinstance(block, SparseMoeBlock) and block.w_gate_up.dtype == torch.float32
    assert type(loaded.model.layers[0].self_attn.qkv_proj).__name__ != "Linear"
    ids = prompts(1, seed=6, min_len=24, max_len=24)[0]
    with torch.no_grad():
        ours = loaded.model.compute_logits(loaded.model(torch.tensor(ids), torch.arange(len(ids)),
                                                        DenseCausalAttention()))
    ref = hf_logits(ckpt, ids)
    assert (ours.argmax(-1) == ref.argmax(-1)).float().mean() > 0.8
