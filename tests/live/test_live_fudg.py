"""FuDG over real processes: prefill on one instance, KV over ZeroMQ raw buffers, decode on another."""
from __future__ import annotations

import openai
import pytest

from tests.live.conftest import instance_args, single_engine_greedy, start_cluster, wait_until
from tests.live.fakes import FakeFuDG

PROMPTS = ["The quick brown fox jumps over the lazy dog. A journey of", "Paris is the capital of",
           "Numbers: one two three four five six seven eight nine ten eleven twelve"]
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def cluster(tiny_model):
    running = start_cluster(tiny_model, lambda step_time, status_of: FakeFuDG(1, 2, status_of), 3,
                            lambda iid: instance_args(tiny_model))
    yield running
    running.stop()


@pytest.fixture(scope="module")
def reference(tiny_model):
    return single_engine_greedy(tiny_model, PROMPTS, MAX_TOKENS)


def _kv_bytes(cluster) -> int:
    return cluster.engine.counters["kv_bytes_moved"]


@pytest.mark.parametrize("direct", [False, True], ids=["staging", "direct"])
def test_decode_after_kv_transfer_equals_local_prefill(cluster, reference, direct):
    cluster.engine.controller.direct = direct
    client = openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="none", timeout=60)
    before = _kv_bytes(cluster)
    for prompt, ref in zip(PROMPTS, reference):
        out = client.completions.create(model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
        assert out.choices[0].text == ref.text
        assert out.choices[0].finish_reason == ref.finish_reason
        stream = client.completions.create(model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                           stream=True)
        assert "".join(c.choices[0].text for c in stream if c.choices) == ref.text
    moved = _kv_bytes(cluster) - before
    # each request's prompt KV moved once: 2 layers x K,V x kv heads x head dim x float32, per token, in whole blocks
    assert moved > 0
    events = cluster.engine.controller.events
    decode_on = {e.instance_id for e in events if type(e).__name__ == "RequestFinished"}
    assert decode_on <= {1, 2} and decode_on


def test_kv_blocks_freed_everywhere(cluster):
    """After the requests, no instance holds pinned or imported KV and all blocks are free."""
    def idle() -> bool:
        return all(i["num_requests"] == 0 and i["free_kv_tokens"] == 128 * 16 for i in cluster.cluster())
    wait_until(idle, 10, "every instance to free its KV")
