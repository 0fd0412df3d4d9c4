"""ModelSpec parsing and load_model: formats, serving facts and clear errors."""
from __future__ import annotations

import json

import pytest
import torch

from ecoserve.model.loader import load_model
from ecoserve.model.spec import SUPPORTED_ARCHITECTURES, ModelLoadError, ModelSpec
from tests.utils import make_tiny_checkpoint, read_json

BASE = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "intermediate_size": 128, "vocab_size": 100}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("llama"), "llama")


def test_spec_defaults_and_derived_head_dim():
    spec = ModelSpec.from_config(BASE)
    assert (spec.num_kv_heads, spec.head_dim, spec.rope.rope_type, spec.rope.theta) == (4, 16, "default", 10000.0)
    assert spec.max_position_embeddings == 2048 and not spec.tie_word_embeddings


def test_spec_reads_transformers4_rope_keys():
    spec = ModelSpec.from_config({**BASE, "rope_theta": 500000.0, "rope_scaling": {
        "type": "linear", "factor": 4.0}})
    assert (spec.rope.theta, spec.rope.rope_type, spec.rope.factor) == (500000.0, "linear", 4.0)


def test_spec_reads_transformers5_rope_parameters():
    spec = ModelSpec.from_config({**BASE, "max_position_embeddings": 4096, "rope_parameters": {
        "rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}})
    assert spec.rope.rope_type == "llama3" and spec.rope.original_max_position_embeddings == 4096


def test_spec_architecture_flags():
    qwen2 = ModelSpec.from_config({**BASE, "architectures": ["Qwen2ForCausalLM"], "use_sliding_window": False,
                                   "sliding_window": 4096})
    assert qwen2.qkv_bias and not qwen2.o_bias and qwen2.sliding_window is None
    qwen3 = ModelSpec.from_config({**BASE, "architectures": ["Qwen3ForCausalLM"], "head_dim": 32})
    assert qwen3.qk_norm and qwen3.head_dim == 32
    mistral = ModelSpec.from_config({**BASE, "architectures": ["MistralForCausalLM"], "sliding_window": 4096})
    assert mistral.sliding_window == 4096
    assert ModelSpec.from_config({k: v for k, v in BASE.items() if k != "architectures"} | {"model_type": "qwen2"}
                                 ).architecture == "Qwen2ForCausalLM"


@pytest.mark.parametrize("config, words", [
    ({**BASE, "architectures": ["GPT2LMHeadModel"]}, ["GPT2LMHeadModel", *SUPPORTED_ARCHITECTURES]),
    ({**BASE, "hidden_size": "big"}, ["hidden_size", "positive integer"]),
    ({k: v for k, v in BASE.items() if k != "vocab_size"}, ["vocab_size", "missing"]),
    ({**BASE, "num_key_value_heads": 3}, ["num_key_value_heads"]),
    ({**BASE, "rope_scaling": {"rope_type": "yarn", "factor": 2.0}}, ["yarn", "linear"]),
    ({**BASE, "hidden_act": "gelu"}, ["gelu", "silu"]),
])
def test_spec_errors_say_what_is_wrong(config, words):
    with pytest.raises(ModelLoadError) as e:
        ModelSpec.from_config(config)
    for word in words:
        assert word in str(e.value)


def test_loaded_model_facts(ckpt):
    loaded = load_model(str(ckpt))
    assert loaded.name == str(ckpt) and loaded.path == ckpt
    assert loaded.eos_token_ids == frozenset({loaded.tokenizer.eos_token_id})
    assert loaded.tokenizer.decode(loaded.tokenizer.encode("Paris is the capital")) == "Paris is the capital"
    assert loaded.generation_defaults == {} and loaded.max_model_len == 1024


def test_eos_union_and_generation_defaults(tmp_path):
    path = make_tiny_checkpoint(tmp_path, "qwen2", generation_config={
        "eos_token_id": [2, 7], "temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05,
        "do_sample": True})
    config = read_json(path / "config.json")
    config["eos_token_id"] = 9
    (path / "config.json").write_text(json.dumps(config))
    loaded = load_model(str(path))
    assert loaded.eos_token_ids == frozenset({2, 7, 9})
    assert loaded.generation_defaults == {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05}


def test_dtype_choice(ckpt):
    assert load_model(str(ckpt)).model.dtype == torch.float32  # auto on CPU
    assert load_model(str(ckpt), dtype="float16").model.dtype == torch.float16
    with pytest.raises(ValueError, match="dtype must be one of"):
        load_model(str(ckpt), dtype="int3")


def test_unsupported_architecture(tmp_path):
    path = make_tiny_checkpoint(tmp_path, "llama")
    config = read_json(path / "config.json")
    config["architectures"] = ["FalconForCausalLM"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="unsupported architecture.*FalconForCausalLM.*LlamaForCausalLM"):
        load_model(str(path))


def test_missing_safetensors(tmp_path):
    path = make_tiny_checkpoint(tmp_path, "llama")
    (path / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=r"no \*\.safetensors"):
        load_model(str(path))


def test_missing_shard(tmp_path):
    path = make_tiny_checkpoint(tmp_path, "llama", max_shard_size="50KB")
    sorted(path.glob("model-*.safetensors"))[-1].unlink()
    with pytest.raises(ModelLoadError, match="missing"):
        load_model(str(path))


def test_weights_that_do_not_fit_the_config(tmp_path):
    path = make_tiny_checkpoint(tmp_path, "llama")
    config = read_json(path / "config.json")
    config["intermediate_size"] = 256
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="shape"):
        load_model(str(path))


def test_malformed_and_missing_config(tmp_path):
    path = make_tiny_checkpoint(tmp_path, "llama")
    (path / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="malformed .*config.json"):
        load_model(str(path))
    (path / "config.json").unlink()
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_model(str(path))


def test_unknown_hub_id_offline(monkeypatch, tmp_path):
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(ModelLoadError, match="not in the Hugging Face cache.*HF_HUB_OFFLINE"):
        load_model("no-such-org/no-such-model")


def test_missing_local_paths():
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model("/nonexistent/model.gguf")
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model("/nonexistent/dir")
