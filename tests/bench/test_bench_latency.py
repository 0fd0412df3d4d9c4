"""`ecoserve bench latency`: quantization side by side, the llama.cpp peer (a stand-in llama_cpp
package here), ratios and --profile."""
from __future__ import annotations

import argparse
import json
import sys
import textwrap

import pytest
import torch
from gguf import GGMLQuantizationType as GGML

from ecoserve.bench import latency, peers
from ecoserve.bench.profile import cprofile_top, torch_breakdown
from tests.utils import make_tiny_checkpoint, make_tiny_gguf

# Yields tokens without end like llama-cpp-python's `generate` (EOS banned by the logits processor, which must
# take it out: the fake samples the largest score); checks the calls our script makes.
_FAKE_LLAMA_CPP = textwrap.dedent("""
    class LogitsProcessorList(list):
        def __call__(self, ids, scores):
            for processor in self:
                scores = processor(ids, scores)
            return scores
    class Llama:
        def __init__(self, model_path, n_threads, n_threads_batch, n_ctx, seed, verbose):
            assert n_threads == n_threads_batch and n_ctx > 0
        def token_eos(self):
            return 2
        def reset(self):
            self.was_reset = True
        def generate(self, tokens, temp, logits_processor):
            assert all(isinstance(t, int) for t in tokens) and temp == 0.0
            while True:
                scores = logits_processor(tokens, [0.0, 0.0, 1.0])
                token = max(range(3), key=scores.__getitem__)
                assert token != 2, "EOS not banned"
                yield token
""")


@pytest.fixture
def fake_peer(stand_in_package):
    return stand_in_package("llama_cpp", _FAKE_LLAMA_CPP)


def test_llama_cpp_peer_figures(fake_peer, tmp_path):
    figures = peers.llama_cpp_decode(fake_peer, tmp_path / "m.gguf", [5, 6, 7], 9, 1)
    assert figures["tokens"] == 9 and figures["decode_tokens_per_s"] > 0 and figures["cpu_ms_per_token"] >= 0


def test_missing_llama_cpp_is_reported(tmp_path):
    with pytest.raises(peers.PeerUnavailable, match="No module named 'llama_cpp'"):
        peers.llama_cpp_decode(sys.executable, tmp_path / "m.gguf", [5], 4, 1)


@pytest.mark.slow
def test_latency_runs_quantizations_and_peer_side_by_side(fake_peer, tmp_path, capsys):
    model = make_tiny_gguf(make_tiny_checkpoint(tmp_path / "ckpt", "llama"), tmp_path / "q8.gguf", GGML.Q8_0)
    parser = argparse.ArgumentParser()
    latency.add_parser(parser.add_subparsers())
    args = parser.parse_args(["latency", "--model", str(model), "--prompt-len", "6", "--output-len", "8",
                              "--num-threads", "1", "--quantization", "none", "gguf", "--compare", "llama-cpp",
                              "--peer-python", fake_peer, "--json", str(tmp_path / "out.json")])
    assert latency.main(args) == 0
    runs = json.loads((tmp_path / "out.json").read_text())["runs"]
    assert [r["system"] for r in runs] == ["ecoserve-float32", "ecoserve-gguf", "llama.cpp"]
    assert all(len(r["rounds"]) == 1 and r["rounds"][0]["decode_tokens_per_s"] > 0 for r in runs)
    out = capsys.readouterr().out
    assert "llama.cpp / ecoserve-gguf: decode tokens/s x" in out and "ecoserve-gguf / ecoserve-float32" in out


@pytest.mark.slow
def test_latency_runs_dtypes_side_by_side(tmp_path, capsys):
    """--dtypes: one float-weight run per dtype, named by the dtype it ran in; a quantized run keeps --dtype."""
    model = make_tiny_gguf(make_tiny_checkpoint(tmp_path / "ckpt", "llama"), tmp_path / "q8.gguf", GGML.Q8_0)
    parser = argparse.ArgumentParser()
    latency.add_parser(parser.add_subparsers())
    args = parser.parse_args(["latency", "--model", str(model), "--prompt-len", "6", "--output-len", "8",
                              "--num-threads", "1", "--quantization", "none", "gguf", "--dtypes", "bfloat16",
                              "float32", "--json", str(tmp_path / "out.json")])
    assert latency.main(args) == 0
    runs = json.loads((tmp_path / "out.json").read_text())["runs"]
    assert [(r["system"], r["dtype"], r["quantization"]) for r in runs] == [
        ("ecoserve-bfloat16", "bfloat16", "none"), ("ecoserve-float32", "float32", "none"),
        ("ecoserve-gguf", "auto", "gguf")]
    assert "ecoserve-float32 / ecoserve-bfloat16: decode tokens/s x" in capsys.readouterr().out


def test_compare_needs_a_gguf_model(tmp_path):
    args = argparse.Namespace(model=str(tmp_path), quantization=["none"], compare="llama-cpp")
    with pytest.raises(SystemExit, match="needs a .gguf model"):
        latency.main(args)


def test_profile_attributes_matmuls_and_python():
    a = torch.randn(256, 256)

    def work():
        for _ in range(20):
            torch.mm(a, a).add_(1)
        sum(i * i for i in range(200_000))  # Python time: outside every aten op

    table = torch_breakdown(work, 20, "step")
    assert "per step (20 steps" in table
    shares = {line[:54].strip(): float(line.split()[-1].rstrip("%")) for line in table.splitlines()[1:]}
    assert shares["GEMM (linears)"] > 0 and shares["Python and the rest"] > 0
    assert "work" in cprofile_top(work)
