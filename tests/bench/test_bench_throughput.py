"""`ecoserve bench throughput` on a tiny checkpoint: quantized weights, process CPU, --profile, and
vLLM as a peer (a stand-in `vllm` package here that checks the calls and the environment)."""
from __future__ import annotations

import argparse
import json
import sys
import textwrap

import pytest

from ecoserve.bench import peers, throughput
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
    assert "ecoserve / vllm-cpu output tokens per CPU second:" in out
    assert "per output token" in out
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
            assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "0-0" and dtype == "float32"
        def generate(self, prompts, params, use_tqdm):
            assert all(isinstance(t, int) for p in prompts for t in p["prompt_token_ids"])
            return [_Out(p.max_tokens) for p in params]
""")


@pytest.fixture
def fake_vllm(stand_in_package):
    return stand_in_package("vllm", _FAKE_VLLM)


def test_vllm_peer_runs_the_same_requests(fake_vllm, tmp_path):
    out = peers.vllm_generate(fake_vllm, tmp_path, [[5, 6], [7, 8, 9]], [3, 4], 1, 2048, 256)
    assert out["output_tokens"] == 7 and out["elapsed_s"] >= 0 and out["cpu_s"] >= 0


def test_missing_vllm_is_a_clear_error(tmp_path):
    with pytest.raises(peers.PeerUnavailable, match="No module named 'vllm'"):
        peers.vllm_generate(sys.executable, tmp_path, [[5]], [2], 1, 2048, 256)
