"""`ecoserve bench throughput` on a tiny checkpoint: quantized weights, process CPU, --profile, and
vLLM as a peer (a stand-in `vllm` package here that checks the calls and the environment)."""
from __future__ import annotations

import argparse
import json
import sys
import textwrap

import pytest
import torch

from ecoserve.bench import peers, throughput
from ecoserve.bench.profile import ATTENTION, CATEGORIES, ELEMENTWISE, GEMM, REST, SAMPLING, peer_breakdown
from ecoserve.model import quant
from tests.utils import make_tiny_checkpoint


def test_throughput_with_int8_weights_profile_and_vllm_peer(fake_vllm, tmp_path, capsys):
    model = make_tiny_checkpoint(tmp_path / "ckpt", "llama")
    parser = argparse.ArgumentParser()
    throughput.add_parser(parser.add_subparsers())
    args = parser.parse_args(["throughput", "--model", str(model), "--num-prompts", "3", "--input-len-range", "4", "9",
                              "--output-len-range", "2", "5", "--num-threads", "1", "--quantization", "int8",
                              "--profile", "--no-tqdm", "--compare", "vllm", "--peer-python", fake_vllm,
                              "--json", str(tmp_path / "out.json")])
    assert throughput.main(args) == 0
    ours, peer = json.loads((tmp_path / "out.json").read_text())["results"]
    assert ours["output_tokens_per_s"] > 0 and ours["cpu_s"] > 0 and peer["system"] == "vllm-cpu"
    out = capsys.readouterr().out
    assert "ecoserve int8 float32 / vllm-cpu float32 output tokens per CPU second:" in out
    assert _vllm_dtypes(tmp_path) == ["float32"]  # the dtype our run resolved (auto: float32 here)
    assert "where the time goes" in out
    assert ours["profile"]["seconds"]["GEMM (linears)"] > 0  # the int8 layers' native matmul counts as GEMM
    assert "quant_linear" in out or quant._native() is None  # the int8 layers ran the native kernel


_FAKE_VLLM = textwrap.dedent("""
    import os
    class SamplingParams:
        def __init__(self, temperature, max_tokens, ignore_eos):
            assert temperature == 0.0 and ignore_eos
            self.max_tokens = max_tokens
    class _Out:
        def __init__(self, n):
            self.outputs = [type("C", (), {"token_ids": [7] * n})()]
    class LLM:
        def __init__(self, model, dtype, seed, max_num_batched_tokens, max_num_seqs, max_model_len):
            assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
            assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "0-0"
            with open(os.environ["FAKE_VLLM_LOG"], "a") as log:  # the dtypes it was started with, in order
                log.write(dtype + "\\n")
        def generate(self, prompts, params, use_tqdm):
            assert all(isinstance(t, int) for p in prompts for t in p["prompt_token_ids"])
            return [_Out(p.max_tokens) for p in params]
""")


@pytest.fixture
def fake_vllm(stand_in_package, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_VLLM_LOG", str(tmp_path / "vllm_dtypes.log"))
    return stand_in_package("vllm", _FAKE_VLLM)


def _vllm_dtypes(tmp_path) -> list[str]:
    return (tmp_path / "vllm_dtypes.log").read_text().split()


def test_vllm_peer_runs_the_same_requests(fake_vllm, tmp_path):
    out = peers.vllm_generate(fake_vllm, tmp_path, [[5, 6], [7, 8, 9]], [3, 4], 1, 2048, 256, "bfloat16")
    assert out["output_tokens"] == 7 and out["elapsed_s"] >= 0 and out["cpu_s"] >= 0
    assert _vllm_dtypes(tmp_path) == ["bfloat16"]


def test_dtypes_run_ours_and_vllm_at_each_precision(fake_vllm, tmp_path, capsys):
    """--dtypes bfloat16 float32: ours at both, vLLM at both, each compared at its own dtype, bf16 against f32."""
    model = make_tiny_checkpoint(tmp_path / "ckpt", "llama")
    parser = argparse.ArgumentParser()
    throughput.add_parser(parser.add_subparsers())
    args = parser.parse_args(["throughput", "--model", str(model), "--num-prompts", "3", "--input-len-range", "4", "9",
                              "--output-len-range", "2", "5", "--num-threads", "1", "--no-tqdm", "--dtypes", "bfloat16",
                              "float32", "--compare", "vllm", "--peer-python", fake_vllm, "--profile",
                              "--json", str(tmp_path / "out.json")])
    assert throughput.main(args) == 0
    assert _vllm_dtypes(tmp_path) == ["bfloat16", "float32"]
    report = json.loads((tmp_path / "out.json").read_text())
    rows = [(r["system"], r["dtype"]) for r in report["results"]]
    assert rows == [("ecoserve", "bfloat16"), ("ecoserve", "float32"), ("vllm-cpu", "bfloat16"),
                    ("vllm-cpu", "float32")]
    assert set(report["ratios"]) >= {"ecoserve bfloat16 / vllm-cpu bfloat16 output throughput",
                                     "ecoserve float32 / vllm-cpu float32 output throughput",
                                     "ecoserve bfloat16 / ecoserve float32 output throughput"}
    assert "ecoserve bfloat16 / vllm-cpu float32 output throughput" not in report["ratios"]
    ours_bf16, ours_f32 = report["results"][:2]
    assert report["ratios"]["ecoserve bfloat16 / ecoserve float32 output throughput"] == pytest.approx(
        ours_bf16["output_tokens_per_s"] / ours_f32["output_tokens_per_s"])
    assert {r["dtype"] for r in report["roofline"]} == {"bfloat16", "float32"}
    for row in (ours_bf16, ours_f32):
        profile = row["profile"]
        assert profile["roofline"]["dtype"] == row["dtype"] and profile["steps"] > 0
        assert sum(profile["shares"].values()) == pytest.approx(1.0)
        assert profile["work"]["gemm_flops"] > 0 and profile["streamed_bytes"] > 0
    assert report["results"][2]["profile"] is None  # vLLM's profile is its ops' self time, not our breakdown
    peer = report["results"][2]["peer_profile"]
    assert set(peer["seconds"]) == set(CATEGORIES) and peer["seconds"][REST] >= 0
    out = capsys.readouterr().out
    assert "where the time goes" in out and "ecoserve bfloat16 / ecoserve float32 output throughput:" in out
    assert "where the time goes: vllm-cpu bfloat16 (torch.profiler" in out


def test_a_peer_profile_counts_vllm_ops_by_category_and_the_rest_from_its_wall_time():
    ops = {"_C::onednn_mm": 2.0, "_C::cpu_attention_with_kv_cache": 1.0, "## Call CompiledFxGraph None ##": 0.5,
           "_C::greedy_argmax": 0.25, "aten::view": 0.1}
    entry, table = peer_breakdown("vllm-cpu bfloat16", 5.0, ops, top=2)
    assert entry["seconds"] == {GEMM: 2.0, ATTENTION: 1.0, ELEMENTWISE: 0.5, SAMPLING: 0.25, REST: 1.25}
    assert entry["top_ops"] == {"_C::onednn_mm": 2.0, "_C::cpu_attention_with_kv_cache": 1.0}
    assert "vllm-cpu bfloat16" in table and "_C::onednn_mm 2.00 s" in table


def test_the_random_checkpoint_is_stored_in_the_runs_16_bit_dtype(tmp_path, monkeypatch):
    import torch
    from safetensors import safe_open

    assert throughput.checkpoint_dtype(["bfloat16", "float32"]) == "bfloat16"
    assert throughput.checkpoint_dtype(["float32"]) == throughput.checkpoint_dtype(["auto"]) == "float32"
    monkeypatch.setattr(throughput, "LLAMA_125M", dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                                       num_key_value_heads=1, intermediate_size=32, vocab_size=128))
    path = throughput.make_random_model(tmp_path / "bf16", "llama-125m", "bfloat16")
    config = json.loads((path / "config.json").read_text())
    assert config.get("dtype", config.get("torch_dtype")) == "bfloat16"
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
    monkeypatch.setenv("ECOSERVE_BENCH_DIR", str(tmp_path))
    assert throughput.random_model_dir("llama-125m", "float32").name == "ecoserve-llama-125m-random"
    assert throughput.random_model_dir("llama-125m", "bfloat16").name == "ecoserve-llama-125m-random-bfloat16"


def test_missing_vllm_is_a_clear_error(tmp_path):
    with pytest.raises(peers.PeerUnavailable, match="No module named 'vllm'"):
        peers.vllm_generate(sys.executable, tmp_path, [[5]], [2], 1, 2048, 256, "float32")


def _row(system: str, dtype: str, out_tok_s: float, cpu_s: float | None = None) -> throughput.Figures:
    return throughput.Figures(system, 10.0, 1.0, out_tok_s, 2 * out_tok_s, cpu_s=cpu_s, dtype=dtype)


def test_ratios_compare_equal_dtypes_the_first_dtype_and_the_first_setup():
    rows = [_row("ecoserve tp1", "bfloat16", 300.0, 10.0), _row("ecoserve pp2", "bfloat16", 150.0),
            _row("ecoserve tp1", "float32", 200.0, 12.0), _row("ecoserve pp2", "float32", 100.0),
            _row("vllm-cpu", "bfloat16", 250.0, 15.0), _row("vllm-cpu", "float32", 100.0)]
    assert throughput.ratios(rows) == pytest.approx({
        "ecoserve tp1 bfloat16 / vllm-cpu bfloat16 output throughput": 1.2,
        "ecoserve tp1 bfloat16 / vllm-cpu bfloat16 output tokens per CPU second": 1.5,
        "ecoserve pp2 bfloat16 / vllm-cpu bfloat16 output throughput": 0.6,
        "ecoserve tp1 float32 / vllm-cpu float32 output throughput": 2.0,
        "ecoserve pp2 float32 / vllm-cpu float32 output throughput": 1.0,
        "ecoserve pp2 bfloat16 / ecoserve tp1 bfloat16 output throughput": 0.5,
        "ecoserve tp1 bfloat16 / ecoserve tp1 float32 output throughput": 1.5,
        "ecoserve pp2 bfloat16 / ecoserve pp2 float32 output throughput": 1.5,
        "ecoserve pp2 float32 / ecoserve tp1 float32 output throughput": 0.5,
    })


def test_random_moe_against_dense_in_one_command(tmp_path, monkeypatch, capsys):
    """--random-model with a MoE and a dense model: both run on the same requests, ratios across models."""
    tiny = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                intermediate_size=64, vocab_size=300, max_position_embeddings=256)
    monkeypatch.setattr(throughput, "QWEN3_125M", tiny)
    monkeypatch.setattr(throughput, "QWEN3_MOE_520M_A125M", dict(tiny, num_experts=8, num_experts_per_tok=2,
                                                                 moe_intermediate_size=32, norm_topk_prob=True))
    monkeypatch.setenv("ECOSERVE_BENCH_DIR", str(tmp_path))
    parser = argparse.ArgumentParser()
    throughput.add_parser(parser.add_subparsers())
    args = parser.parse_args(["throughput", "--random-model", "qwen3-moe-520m-a125m", "qwen3-125m",
                              "--num-prompts", "3", "--input-len-range", "4", "9", "--output-len-range", "2", "5",
                              "--num-threads", "1", "--no-tqdm", "--json", str(tmp_path / "out.json")])
    assert throughput.main(args) == 0
    report = json.loads((tmp_path / "out.json").read_text())
    moe, dense = report["models"]["qwen3-moe-520m-a125m"], report["models"]["qwen3-125m"]
    assert json.loads((tmp_path / "ecoserve-qwen3-moe-520m-a125m-random" / "config.json").read_text())[
        "architectures"] == ["Qwen3MoeForCausalLM"]
    assert moe["workload"] == dense["workload"]
    # the MoE's active FLOPs per token: attention + router + 2 experts of 32 = the dense 64
    assert moe["results"][0]["achieved_gflops"] * moe["results"][0]["elapsed_s"] == pytest.approx(
        dense["results"][0]["achieved_gflops"] * dense["results"][0]["elapsed_s"], rel=0.05)
    key = "ecoserve float32: qwen3-moe-520m-a125m / qwen3-125m output throughput"
    assert report["ratios"][key] > 0 and key in capsys.readouterr().out


def test_w8a8_gives_vllm_the_same_int8_weights_once(tmp_path, monkeypatch):
    """`--quantization w8a8 --compare vllm`: vLLM reads a compressed-tensors copy whose decoder linears are the
    integers and scales ours computes; everything else is the float checkpoint's; written once."""
    from safetensors.torch import load_file

    from ecoserve.model.w8a8 import quantize_per_channel

    monkeypatch.setenv("ECOSERVE_CACHE", str(tmp_path / "cache"))
    model = make_tiny_checkpoint(tmp_path / "ckpt", "llama")
    path = peers.vllm_w8a8_checkpoint(model)
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    assert peers.vllm_w8a8_checkpoint(model) == path and (path / "model.safetensors").stat().st_mtime_ns == stamp
    ours, theirs = load_file(model / "model.safetensors"), load_file(path / "model.safetensors")
    linears = [n for n in ours if n.endswith("_proj.weight")]
    assert len(linears) == 7 * 2  # q, k, v, o, gate, up, down in each of the tiny model's two layers
    for name in linears:
        q, scale = quantize_per_channel(ours[name])
        assert theirs[name].dtype == torch.int8 and torch.equal(theirs[name], q)
        assert torch.equal(theirs[name.removesuffix("weight") + "weight_scale"], scale[:, None])
    for name in set(ours) - set(linears):
        assert torch.equal(theirs[name], ours[name])
    config = json.loads((path / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == "compressed-tensors" and config["format"] == "int-quantized"
    with pytest.raises(peers.PeerUnavailable, match="no Llama-family decoder linears"):
        (tmp_path / "empty").mkdir()
        (tmp_path / "empty" / "config.json").write_text("{}")
        peers.vllm_w8a8_checkpoint(tmp_path / "empty")


def test_w8a8_at_two_dtypes_starts_vllm_once_in_bfloat16(fake_vllm, tmp_path, monkeypatch, capsys):
    """vLLM's CPU W8A8 takes bfloat16 activations only: ours at bfloat16 and float32 both face its one bf16 run."""
    monkeypatch.setattr(peers, "vllm_w8a8_checkpoint", lambda path: path)  # the copy itself: the test above
    model = make_tiny_checkpoint(tmp_path / "ckpt", "llama")
    parser = argparse.ArgumentParser()
    throughput.add_parser(parser.add_subparsers())
    args = parser.parse_args(["throughput", "--model", str(model), "--num-prompts", "2", "--input-len-range", "4", "6",
                              "--output-len-range", "2", "3", "--num-threads", "1", "--no-tqdm", "--quantization",
                              "w8a8", "--dtypes", "bfloat16", "float32", "--compare", "vllm", "--peer-python",
                              fake_vllm, "--json", str(tmp_path / "out.json")])
    assert throughput.main(args) == 0
    assert _vllm_dtypes(tmp_path) == ["bfloat16"]
    report = json.loads((tmp_path / "out.json").read_text())
    assert [(r["system"], r["dtype"], r["weights"]) for r in report["results"]] == [
        ("ecoserve", "bfloat16", "w8a8"), ("ecoserve", "float32", "w8a8"), ("vllm-cpu", "bfloat16", "w8a8")]
    assert "ecoserve w8a8 bfloat16 / vllm-cpu w8a8 bfloat16 output throughput" in report["ratios"]
    assert "ecoserve w8a8 float32 / vllm-cpu w8a8 bfloat16 output throughput" in report["ratios"]


def test_quantized_runs_are_compared_with_a_peer_on_the_same_weights_or_a_float_peer_at_their_dtype():
    fig = lambda system, dtype, weights, tok_s: throughput.Figures(system, 1.0, 1.0, tok_s, tok_s, dtype=dtype,
                                                                    weights=weights)
    found = throughput.ratios([fig("ecoserve", "float32", "w8a8", 300.0), fig("vllm-cpu", "bfloat16", "w8a8", 200.0),
                               fig("vllm-cpu", "float32", None, 100.0)])
    assert found["ecoserve w8a8 float32 / vllm-cpu w8a8 bfloat16 output throughput"] == pytest.approx(1.5)
    assert found["ecoserve w8a8 float32 / vllm-cpu float32 output throughput"] == pytest.approx(3.0)
    assert len(found) == 2
