"""calculate_metrics on a synthetic fixture whose answers are worked out by hand."""
import math

import pytest

from ecoserve.bench.metrics import (RequestOutput, calculate_metrics, format_table, output_len, parse_goodput,
                                    percentile_key)


def fixture_outputs() -> list[RequestOutput]:
    return [
        # TPOT = (0.16 - 0.10) / (3 - 1) = 30 ms
        RequestOutput(prompt_len=10, output_tokens=3, success=True, generated_text="abc",
                      ttft=0.10, itl=[0.02, 0.04], latency=0.16, start_time=0.0),
        # TPOT = (0.50 - 0.30) / (5 - 1) = 50 ms
        RequestOutput(prompt_len=20, output_tokens=5, success=True, generated_text="abcde",
                      ttft=0.30, itl=[0.03, 0.05, 0.05, 0.07], latency=0.50, start_time=0.4),
        # one token: no TPOT, no ITL
        RequestOutput(prompt_len=30, output_tokens=1, success=True, generated_text="a",
                      ttft=0.20, itl=[], latency=0.20, start_time=1.0),
        RequestOutput(prompt_len=40, success=False, error="HTTP 500: boom", latency=0.01, start_time=0.1),
    ]


def test_totals_and_throughputs():
    r = calculate_metrics(fixture_outputs(), 2.0)
    assert (r["completed"], r["failed"]) == (3, 1)
    assert r["total_input_tokens"] == 60  # failed requests' prompts are not counted
    assert r["total_output_tokens"] == 9
    assert r["request_throughput"] == pytest.approx(1.5)
    assert r["output_throughput"] == pytest.approx(4.5)
    assert r["total_token_throughput"] == pytest.approx(34.5)
    assert r["request_goodput"] is None
    assert r["max_output_tokens_per_s"] == pytest.approx(8)  # 3 + 5 tokens land in second 0
    assert r["max_concurrent_requests"] == 2  # request 1 overlaps the failed one


def test_latency_statistics():
    r = calculate_metrics(fixture_outputs(), 2.0, percentiles=[50, 90, 99])
    # TTFT 100, 300, 200 ms
    assert r["mean_ttft_ms"] == pytest.approx(200)
    assert r["median_ttft_ms"] == pytest.approx(200)
    assert r["std_ttft_ms"] == pytest.approx(math.sqrt(20000 / 3))
    assert r["p99_ttft_ms"] == pytest.approx(298)  # linear interpolation: 200 + 0.98 * 100
    # TPOT 30, 50 ms (the one-token request has none)
    assert r["mean_tpot_ms"] == pytest.approx(40)
    assert r["median_tpot_ms"] == pytest.approx(40)
    assert r["std_tpot_ms"] == pytest.approx(10)
    assert r["p99_tpot_ms"] == pytest.approx(49.8)
    # ITL pooled over all gaps: 20, 30, 40, 50, 50, 70 ms
    assert r["mean_itl_ms"] == pytest.approx(260 / 6)
    assert r["median_itl_ms"] == pytest.approx(45)
    assert r["p90_itl_ms"] == pytest.approx(60)
    assert r["p99_itl_ms"] == pytest.approx(69)
    # E2EL 160, 500, 200 ms
    assert r["mean_e2el_ms"] == pytest.approx(860 / 3)
    assert r["median_e2el_ms"] == pytest.approx(200)
    assert r["p50_e2el_ms"] == pytest.approx(200)


def test_goodput_needs_every_slo():
    outs = fixture_outputs()
    # request 2 misses TTFT; request 3 has one token, so any TPOT SLO holds
    assert calculate_metrics(outs, 2.0, {"ttft": 250, "tpot": 40})["request_goodput"] == pytest.approx(1.0)
    # adding e2el 180 ms also drops request 3 (200 ms)
    assert calculate_metrics(outs, 2.0, {"ttft": 250, "tpot": 40, "e2el": 180})["request_goodput"] == pytest.approx(0.5)
    assert calculate_metrics(outs, 2.0, {"tpot": 29})["request_goodput"] == pytest.approx(0.5)  # only request 3


def test_per_request_lists():
    r = calculate_metrics(fixture_outputs(), 2.0)
    assert r["input_lens"] == [10, 20, 30, 40]
    assert r["output_lens"] == [3, 5, 1, 0]
    assert r["ttfts"] == [0.10, 0.30, 0.20, 0.0]
    assert r["itls"][1] == [0.03, 0.05, 0.05, 0.07]
    assert r["generated_texts"][0] == "abc"
    assert r["errors"] == ["", "", "", "HTTP 500: boom"]


def test_output_len_fallbacks():
    out = RequestOutput(success=True, generated_text="x y z w", itl=[0.1, 0.1])
    assert output_len(out, lambda s: len(s.split())) == 4  # tokenizer on the text
    assert output_len(out) == 3  # one token per streamed chunk
    out.output_tokens = 7
    assert output_len(out, lambda s: 0) == 7  # the usage block wins


def test_no_successful_requests_gives_zeros():
    r = calculate_metrics([RequestOutput(error="refused")], 1.0, {"ttft": 1})
    assert r["completed"] == 0 and r["failed"] == 1
    assert r["mean_ttft_ms"] == 0 and r["p99_itl_ms"] == 0 and r["request_goodput"] == 0


def test_parsers_and_table():
    assert parse_goodput(["ttft:200", "e2el:1e3"]) == {"ttft": 200.0, "e2el": 1000.0}
    for bad in (["ttft=200"], ["foo:1"], ["tpot:x"], ["tpot:-1"]):
        with pytest.raises(ValueError):
            parse_goodput(bad)
    assert percentile_key(99) == "p99" and percentile_key(99.9) == "p99.9"
    with pytest.raises(ValueError):
        calculate_metrics(fixture_outputs(), 0.0)
    table = format_table(calculate_metrics(fixture_outputs(), 2.0, {"ttft": 250}, [50, 99.9]),
                         ["ttft", "e2el"], [50, 99.9], max_concurrency=4)
    assert "Serving Benchmark Result" in table and "Request goodput (req/s):" in table
    assert "P99.9 TTFT (ms):" in table and "Median E2EL (ms):" in table and "TPOT" not in table
