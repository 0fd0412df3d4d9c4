"""`bench serve` end to end against a fake OpenAI-compatible streaming server on 127.0.0.1."""
import argparse
import json

import pytest

from ecoserve.bench.serve import add_cli_args, add_parser, main

KEYS = ["duration", "completed", "failed", "total_input_tokens", "total_output_tokens", "request_throughput",
        "request_goodput", "output_throughput", "total_token_throughput", "input_lens", "output_lens", "ttfts",
        "itls", "generated_texts", "errors", "model_id", "backend", "request_rate"]
KEYS += [f"{s}_{m}_ms" for s in ("mean", "median", "std", "p50", "p99") for m in ("ttft", "tpot", "itl", "e2el")]


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_cli_args(p)
    return p.parse_args(argv)


def run_bench(tmp_path, base_url, *extra: str) -> dict:
    args = parse(["--base-url", base_url, "--num-prompts", "12", "--random-input-len", "16",
                  "--random-output-len", "6", "--ignore-eos", "--disable-tqdm", "--save-result",
                  "--result-dir", str(tmp_path), "--result-filename", "out.json", "--metric-percentiles", "50,99",
                  "--ready-check-timeout-sec", "5", *extra])
    assert main(args) == 0
    return json.loads((tmp_path / "out.json").read_text())


@pytest.mark.parametrize("backend", ["openai", "openai-chat"])
def test_end_to_end_writes_the_json(tmp_path, fake_server, backend, capsys):
    url, state = fake_server()
    r = run_bench(tmp_path, url, "--backend", backend, "--goodput", "ttft:5000", "tpot:1000")
    assert all(k in r for k in KEYS), [k for k in KEYS if k not in r]
    assert r["model_id"] == "fake-model"  # taken from GET /v1/models
    assert r["completed"] == 12 and r["failed"] == 0 and r["errors"] == [""] * 12
    assert r["total_output_tokens"] == 12 * 6 and r["output_lens"] == [6] * 12  # from the usage block
    # no tokenizer: input lengths are the server's counts (chat adds the fake template's 3 tokens)
    assert r["input_lens"] == [16 + (3 if backend == "openai-chat" else 0)] * 12
    assert r["total_input_tokens"] == sum(r["input_lens"])
    assert 0 < r["mean_ttft_ms"] < r["mean_e2el_ms"] < 5000
    assert 0 < r["mean_tpot_ms"] < 1000 and 0 < r["mean_itl_ms"] < 1000
    assert all(len(itl) == 5 for itl in r["itls"])  # 6 chunks with text -> 5 gaps (role delta ignored)
    assert r["generated_texts"][0] == " w0 w1 w2 w3 w4 w5"
    assert r["request_throughput"] == pytest.approx(12 / r["duration"])
    assert r["request_goodput"] == pytest.approx(r["request_throughput"])  # generous SLOs: all good
    assert r["output_throughput"] == pytest.approx(72 / r["duration"])
    body = state.bodies[-1]
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True} and body["ignore_eos"]
    if backend == "openai":
        assert isinstance(body["prompt"], list) and body["max_tokens"] == 6  # token ids without a tokenizer
    else:
        assert body["messages"][0]["role"] == "user" and body["max_completion_tokens"] == 6
    out = capsys.readouterr().out
    assert "Serving Benchmark Result" in out and "P99 TTFT (ms):" in out and "Median ITL (ms):" in out


def test_tokenizer_rate_and_concurrency(tmp_path, fake_server, word_tokenizer_dir):
    url, state = fake_server()
    r = run_bench(tmp_path, url, "--model", "m", "--tokenizer", word_tokenizer_dir, "--request-rate", "100",
                  "--burstiness", "2", "--max-concurrency", "3")
    assert r["completed"] == 12 and r["tokenizer_id"] == word_tokenizer_dir and r["max_concurrency"] == 3
    assert r["input_lens"] == [16] * 12 and isinstance(state.bodies[-1]["prompt"], str)
    assert state.max_in_flight <= 3 and r["max_concurrent_requests"] <= 3
    assert r["duration"] >= 12 / 100  # the last request was not sent before 0.12 s


def test_failed_requests_are_counted_not_fatal(tmp_path, fake_server):
    url, _ = fake_server(fail_every=4)  # requests 4, 8, 12 (counting the ready check) get HTTP 500
    r = run_bench(tmp_path, url, "--percentile-metrics", "ttft,tpot,itl,e2el")
    assert r["completed"] + r["failed"] == 12 and r["failed"] == 3
    assert sum(e.startswith("HTTP 500") for e in r["errors"]) == 3
    assert r["total_output_tokens"] == 6 * r["completed"]


def test_unreachable_server_and_bad_flags_fail_cleanly(tmp_path, capsys):
    assert main(parse(["--base-url", "http://127.0.0.1:9", "--model", "m", "--num-prompts", "2",
                       "--ready-check-timeout-sec", "0", "--disable-tqdm", "--save-result",
                       "--result-dir", str(tmp_path), "--result-filename", "x.json"])) == 0
    assert json.loads((tmp_path / "x.json").read_text())["failed"] == 2
    assert main(parse(["--goodput", "ttft=3", "--model", "m"])) == 2
    assert main(parse(["--percentile-metrics", "ttft,foo", "--model", "m"])) == 2
    assert "--percentile-metrics takes" in capsys.readouterr().err


def test_add_parser_registers_serve():
    root = argparse.ArgumentParser()
    add_parser(root.add_subparsers(dest="cmd"))
    args = root.parse_args(["serve", "--request-rate", "2", "--goodput", "ttft:100", "e2el:900"])
    assert args.func is main and args.request_rate == 2 and args.goodput == ["ttft:100", "e2el:900"]
    assert args.backend == "openai" and args.num_prompts == 1000 and args.percentile_metrics == "ttft,tpot,itl"
