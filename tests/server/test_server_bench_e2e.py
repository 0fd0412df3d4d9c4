"""`ecoserve bench serve` end to end against our own server: it completes every request and writes the JSON."""
from __future__ import annotations

import argparse
import json

import pytest

from ecoserve.bench.serve import add_cli_args, main


@pytest.mark.parametrize("backend", ["openai", "openai-chat"])
def test_bench_serve_against_our_server(server, tiny_model, tmp_path, backend):
    p = argparse.ArgumentParser()
    add_cli_args(p)
    args = p.parse_args(["--base-url", server.url, "--backend", backend, "--tokenizer", tiny_model,
                         "--num-prompts", "8", "--random-input-len", "16", "--random-output-len", "8",
                         "--ignore-eos", "--request-rate", "50", "--disable-tqdm", "--save-result",
                         "--result-dir", str(tmp_path), "--result-filename", "r.json",
                         "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
                         "--ready-check-timeout-sec", "30"])
    assert main(args) == 0
    r = json.loads((tmp_path / "r.json").read_text())
    assert r["completed"] == 8 and r["failed"] == 0, r["errors"]
    assert r["model_id"] == "tiny" and r["total_output_tokens"] == 64 and r["output_lens"] == [8] * 8
    assert r["output_throughput"] > 0 and 0 < r["median_ttft_ms"] <= r["p99_e2el_ms"]
    assert len(r["itls"]) == 8  # (a fast tiny model may deliver several tokens in one chunk)
