"""Every strategy over real instance processes, with the controllers the simulator runs: greedy outputs through
the cluster equal one engine's (one prompt at a time, so batch shapes match), streaming and not, openai client."""
from __future__ import annotations

import openai
import pytest

from tests.live.conftest import engine_args, single_engine_greedy, start_strategy

PROMPTS = ["The quick brown fox jumps over", "Paris is the capital of", "Once upon a time there was a small"]
MAX_TOKENS = 8
CASES = {"vllm": (2, {}), "sarathi": (2, {}), "distserve": (3, {"pd": (1, 2)}), "mooncake": (3, {"pd": (1, 2)}),
         "ecoserve": (2, {})}


@pytest.fixture(scope="module")
def reference(tiny_model):
    return single_engine_greedy(tiny_model, PROMPTS, MAX_TOKENS)


@pytest.fixture(scope="module", params=list(CASES))
def cluster(request, tiny_model):
    n, extra = CASES[request.param]
    running = start_strategy(tiny_model, request.param, n, engine_args(tiny_model), **extra)
    yield request.param, running
    running.stop()


def test_greedy_equals_single_engine(cluster, reference):
    strategy, running = cluster
    client = openai.OpenAI(base_url=f"{running.url}/v1", api_key="none", timeout=60, max_retries=0)
    for prompt, ref in zip(PROMPTS, reference):
        out = client.completions.create(model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
        assert out.choices[0].text == ref.text, strategy
        stream = client.completions.create(model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                           stream=True)
        assert "".join(c.choices[0].text for c in stream if c.choices) == ref.text, strategy
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hello"}],
                                          max_tokens=4, temperature=0)
    assert chat.choices[0].message.content is not None
    instances = running.cluster()
    if strategy in ("distserve", "mooncake"):
        assert [i["role"] for i in instances] == ["prefill", "decode", "decode"]
        assert running.engine.counters["kv_bytes_moved"] > 0
    if strategy == "ecoserve":
        assert [i["role"] for i in instances] == [0, 0]
        assert sum(i["num_windows"] for i in instances) >= 1
