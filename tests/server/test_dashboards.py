"""Every series a shipped or vLLM Grafana dashboard queries is on /metrics, with the labels its panels use."""
from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tests.dashboard_series import dashboard_series, expr_series, scraped_families, scraped_labels
from tests.server.conftest import start_server, wait_idle

ROOT = Path(__file__).resolve().parents[2]
VLLM_LIST = Path(__file__).parent / "data" / "vllm_dashboard_metrics.txt"


def _vllm_series() -> set[str]:
    return {line.strip() for line in VLLM_LIST.read_text().splitlines() if line.strip() and not line.startswith("#")}


def _scrape_after_one_completion(model: str, prefix: str) -> str:
    running = start_server(model, app_kwargs={"metrics_prefix": prefix})
    try:
        r = httpx.post(f"{running.url}/v1/completions", timeout=60,
                       json={"model": "tiny", "prompt": "hello there", "max_tokens": 4, "ignore_eos": True})
        assert r.status_code == 200, r.text
        wait_idle(running)
        return httpx.get(f"{running.url}/metrics").text
    finally:
        running.stop()


@pytest.fixture(scope="module")
def ecoserve_scrape(tiny_model) -> str:
    return _scrape_after_one_completion(tiny_model, "ecoserve")


@pytest.fixture(scope="module")
def vllm_scrape(tiny_model) -> str:
    return _scrape_after_one_completion(tiny_model, "vllm")


def test_expr_series_strips_functions_matchers_and_suffixes():
    expr = ('histogram_quantile(0.9, sum by(le) (rate(vllm:e2e_request_latency_seconds_bucket{model_name="$m", '
            'x=~"vllm:nope"}[$__rate_interval]))) / rate(vllm:prompt_tokens_total[5m]) '
            '+ vllm:iteration_tokens_total_bucket + vllm:gpu_cache_usage_perc')
    assert expr_series(expr) == {"vllm:e2e_request_latency_seconds", "vllm:prompt_tokens",
                                 "vllm:iteration_tokens_total", "vllm:gpu_cache_usage_perc"}


def test_dashboard_series_reads_nested_rows(tmp_path):
    path = tmp_path / "d.json"
    path.write_text('{"panels": [{"type": "row", "panels": [{"targets": [{"expr": "a:x_count"}]}]},'
                    ' {"targets": [{"expr": "rate(a:y_total[1m])"}, {"refId": "B"}]}]}')
    assert dashboard_series(path) == {"a:x", "a:y"}


def _check(series: set[str], text: str) -> None:
    missing = series - scraped_families(text)
    assert not missing, f"queried but not exposed: {sorted(missing)}"
    labels = scraped_labels(text)
    for name in series:
        assert "model_name" in labels[name], name


def test_ecoserve_dashboard_series_exist(ecoserve_scrape):
    series = dashboard_series(ROOT / "docs" / "grafana" / "ecoserve.json")
    assert len(series) >= 15 and all(s.startswith("ecoserve:") for s in series)
    _check(series, ecoserve_scrape)
    assert "finished_reason" in scraped_labels(ecoserve_scrape)["ecoserve:request_success"]


def test_vllm_dashboard_series_exist(vllm_scrape):
    series = _vllm_series()
    assert "vllm:gpu_cache_usage_perc" in series and all(s.startswith("vllm:") for s in series)
    _check(series, vllm_scrape)
    assert "finished_reason" in scraped_labels(vllm_scrape)["vllm:request_success"]


def test_issue_series_exist_and_count_the_request(vllm_scrape):
    """The documented production series beyond the dashboard, observed once for the one completion."""
    families = scraped_families(vllm_scrape)
    for name in ("time_per_output_token_seconds", "request_time_per_output_token_seconds", "kv_cache_usage_perc",
                 "request_inference_time_seconds", "request_params_n", "request_params_max_tokens",
                 "iteration_tokens_total",
                 "prefix_cache_queries", "prefix_cache_hits", "num_preemptions"):
        assert "vllm:" + name in families, name
    samples = {line.split(" ")[0]: float(line.split(" ")[1]) for line in vllm_scrape.splitlines()
               if line and not line.startswith("#")}
    one = 'model_name="tiny"'
    assert samples[f"vllm:request_generation_tokens_sum{{{one}}}"] == 4
    assert samples[f"vllm:request_max_num_generation_tokens_sum{{{one}}}"] == 4
    assert samples[f"vllm:request_params_n_count{{{one}}}"] == 1
    assert samples[f"vllm:request_params_max_tokens_count{{{one}}}"] == 1
    assert samples[f"vllm:request_params_max_tokens_sum{{{one}}}"] == 4
    assert samples[f"vllm:request_prompt_tokens_sum{{{one}}}"] >= 1
    assert samples[f"vllm:time_per_output_token_seconds_count{{{one}}}"] == 3
    assert samples[f"vllm:iteration_tokens_total_sum{{{one}}}"] >= 4 + samples[f"vllm:request_prompt_tokens_sum{{{one}}}"] - 1
    assert samples[f'vllm:request_success_total{{finished_reason="length",{one}}}'] == 1
