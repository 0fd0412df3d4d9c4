"""A NoDG cluster of two real instance processes: greedy outputs equal one engine's, with the openai client."""
from __future__ import annotations

import httpx
import openai
import pytest

from tests.live.conftest import instance_args, single_engine_greedy, start_cluster
from tests.live.fakes import FakeNoDG

PROMPTS = ["The quick brown fox", "Paris is the capital of", "Once upon a time there was", "Hello, world!"]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def cluster(tiny_model):
    running = start_cluster(tiny_model, lambda step_time, status_of: FakeNoDG([0, 1], status_of), 2,
                            lambda iid: instance_args(tiny_model))
    yield running
    running.stop()


@pytest.fixture(scope="module")
def reference(tiny_model):
    return single_engine_greedy(tiny_model, PROMPTS, MAX_TOKENS)


def test_greedy_equals_single_engine(cluster, reference):
    client = openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="none", timeout=60)
    for prompt, ref in zip(PROMPTS, reference):
        out = client.completions.create(model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
        assert out.choices[0].text == ref.text
        assert out.usage.completion_tokens == len(ref.token_ids)
        stream = client.completions.create(model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                           stream=True)
        assert "".join(c.choices[0].text for c in stream if c.choices) == ref.text
    # round robin: both instances served
    served = [e.instance_id for e in cluster.engine.controller.events if type(e).__name__ == "RequestFinished"]
    assert set(served) == {0, 1}


def test_cluster_endpoint(cluster):
    instances = cluster.cluster()
    assert [i["id"] for i in instances] == [0, 1]
    for i in instances:
        assert i["state"] == "ready" and i["pid"] > 0 and i["host"]
        assert i["status_age_s"] is not None and i["status_age_s"] < 2.0
        assert set(i) >= {"id", "pid", "host", "state", "role", "phase", "status_age_s", "num_requests"}


def test_metrics_per_instance(cluster):
    text = httpx.get(f"{cluster.url}/metrics").text
    assert 'ecoserve:instance_state{instance="0",model_name="tiny",state="ready"} 1.0' in text
    assert "ecoserve:instance_free_kv_tokens" in text and "ecoserve:cluster_kv_bytes_moved_total" in text
    assert "ecoserve:time_to_first_token_seconds_count" in text
