"""Our Llama-family model against HF transformers on tiny random checkpoints.

Tolerance: float32 logits within 1e-4 (max abs) of HF's; greedy tokens identical.
"""
from __future__ import annotations

import pytest
import torch

from ecoserve.model.loader import load_model
from tests.utils import (DenseCausalAttention, PerSequenceAttention, dense_greedy, hf_greedy, hf_logits,
                         make_tiny_checkpoint, prompts)

ARCHS = ["llama", "mistral", "qwen2", "qwen3"]
ATOL = 1e-4


def our_logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        hidden = model(torch.tensor(ids), torch.arange(len(ids)), DenseCausalAttention())
        return model.compute_logits(hidden)


def assert_matches_hf(path, ids: list[int], atol: float = ATOL) -> None:
    model = load_model(str(path)).model
    ours, ref = our_logits(model, ids), hf_logits(path, ids)
    assert ours.dtype == torch.float32 and ours.shape == ref.shape
    assert (ours - ref).abs().max().item() < atol


@pytest.fixture(scope="module", params=ARCHS)
def arch_ckpt(request, tmp_path_factory):
    return request.param, make_tiny_checkpoint(tmp_path_factory.mktemp(request.param), request.param)


def test_logits_match_hf(arch_ckpt):
    arch, path = arch_ckpt
    for ids in prompts(3, seed=7, max_len=60):
        assert_matches_hf(path, ids)


def test_greedy_matches_hf_64_tokens(arch_ckpt):
    _, path = arch_ckpt
    model = load_model(str(path)).model
    for ids in prompts(4, seed=11):
        assert dense_greedy(model, ids, 64) == hf_greedy(path, ids, 64, ignore_eos=True)


def test_model_facts(arch_ckpt):
    arch, path = arch_ckpt
    loaded = load_model(str(path))
    m = loaded.model
    assert (m.num_layers, m.num_kv_heads, m.head_dim, m.dtype) == (2, 2, 16, torch.float32)
    assert loaded.spec.qkv_bias == (arch == "qwen2") and loaded.spec.qk_norm == (arch == "qwen3")
    assert loaded.max_model_len == 1024


@pytest.mark.parametrize("rope_scaling", [
    {"rope_type": "linear", "factor": 2.0},
    {"rope_type": "dynamic", "factor": 2.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 64},
], ids=lambda r: r["rope_type"])
def test_rope_variants_match_hf(tmp_path, rope_scaling):
    # a large theta on llama3 puts frequencies in all three bands (kept, blended, slowed)
    path = make_tiny_checkpoint(tmp_path, "llama", rope_scaling=rope_scaling, max_position_embeddings=256,
                                rope_theta=500000.0 if rope_scaling["rope_type"] == "llama3" else 10000.0)
    ids = prompts(1, seed=3, min_len=200, max_len=200)[0]  # positions within max_position_embeddings
    assert_matches_hf(path, ids)


def test_dynamic_rope_beyond_trained_length_matches_hf_decoding(tmp_path):
    # past max_position_embeddings each position uses the base HF uses when it is the newest token
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from tests.utils import hf_model
    path = make_tiny_checkpoint(tmp_path, "llama", rope_scaling={"rope_type": "dynamic", "factor": 2.0},
                                max_position_embeddings=32)
    model = load_model(str(path)).model
    model.ensure_positions(48)
    config = hf_model(path).config
    for pos in (32, 40, 47):
        inv_freq, _ = ROPE_INIT_FUNCTIONS["dynamic"](config, None, seq_len=pos + 1)
        angles = pos * inv_freq
        assert torch.allclose(model.rotary.cos[pos], angles.cos(), atol=1e-6)
        assert torch.allclose(model.rotary.sin[pos], angles.sin(), atol=1e-6)


def test_qwen3_explicit_head_dim(tmp_path):
    path = make_tiny_checkpoint(tmp_path, "qwen3", head_dim=32)  # != hidden / heads = 16
    assert load_model(str(path)).model.head_dim == 32
    assert_matches_hf(path, prompts(1, seed=5)[0])


def test_attention_bias_llama(tmp_path):
    path = make_tiny_checkpoint(tmp_path, "llama", attention_bias=True, mlp_bias=True)
    assert_matches_hf(path, prompts(1, seed=6)[0])


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tied_embeddings(tmp_path, arch):
    path = make_tiny_checkpoint(tmp_path, arch, tie_word_embeddings=True)
    model = load_model(str(path), cpu_linear="torch").model  # the tie itself; packing copies it
    assert model.lm_head.weight.data_ptr() == model.embed_tokens.weight.data_ptr()
    assert_matches_hf(path, prompts(1, seed=8)[0])


def test_sharded_checkpoint(tmp_path):
    path = make_tiny_checkpoint(tmp_path, "llama", max_shard_size="50KB")
    assert (path / "model.safetensors.index.json").is_file()
    assert len(list(path.glob("*.safetensors"))) > 1
    assert_matches_hf(path, prompts(1, seed=9)[0])


def test_flattened_batch_equals_separate_runs(arch_ckpt):
    _, path = arch_ckpt
    model = load_model(str(path)).model
    a, b = prompts(2, seed=13, min_len=5)
    with torch.no_grad():
        hidden = model(torch.tensor(a + b), torch.tensor(list(range(len(a))) + list(range(len(b)))),
                       PerSequenceAttention([len(a), len(b)]))
        both = model.compute_logits(hidden)
    # decode-sized calls (the separate runs' last rows) and larger ones go through different GEMM loops, which
    # sum in different orders: equal up to float32 reassociation
    torch.testing.assert_close(both, torch.cat([our_logits(model, a), our_logits(model, b)]), atol=1e-5, rtol=1e-5)


def test_bfloat16_as_accurate_as_hf(arch_ckpt):
    _, path = arch_ckpt
    model = load_model(str(path), dtype="bfloat16").model
    assert model.dtype == torch.bfloat16 and model.rotary.cos.dtype == torch.bfloat16
    ids = prompts(1, seed=2)[0]
    exact = hf_logits(path, ids)
    # bf16 matmul kernels round differently, so compare errors against the float32 reference
    ours_err = (our_logits(model, ids) - exact).abs().max().item()
    hf_err = (hf_logits(path, ids, dtype=torch.bfloat16) - exact).abs().max().item()
    assert ours_err < 2 * hf_err + 0.05
