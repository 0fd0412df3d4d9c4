"""`ecoserve bench throughput` on a tiny checkpoint: quantized weights, process CPU and --profile."""
from __future__ import annotations

import argparse
import json

from ecoserve.bench import throughput
from ecoserve.model import quant
from tests.utils import make_tiny_checkpoint


def test_throughput_with_int8_weights_and_profile(tmp_path, capsys):
    model = make_tiny_checkpoint(tmp_path / "ckpt", "llama")
    parser = argparse.ArgumentParser()
    throughput.add_parser(parser.add_subparsers())
    args = parser.parse_args(["throughput", "--model", str(model), "--num-prompts", "3", "--input-len-range", "4", "9",
                              "--output-len-range", "2", "5", "--num-threads", "1", "--quantization", "int8",
                              "--profile", "--no-tqdm", "--json", str(tmp_path / "out.json")])
    assert throughput.main(args) == 0
    result = json.loads((tmp_path / "out.json").read_text())["results"][0]
    assert result["output_tokens_per_s"] > 0 and result["cpu_s"] > 0
    out = capsys.readouterr().out
    assert "per output token" in out
    assert "quant_linear" in out or quant._native() is None  # the int8 layers ran the native kernel
