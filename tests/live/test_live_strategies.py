"""Every strategy over real instance processes, with the controllers the simulator runs: greedy outputs through
the cluster equal one engine's (one prompt at a time, so batch shapes match), streaming and not, openai client."""
from __future__ import annotations

import json

import jsonschema
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


SCHEMA = {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]}, "age": {"type": "integer", "minimum": 0,
                                                                                 "maximum": 20}},
          "required": ["kind", "age"], "additionalProperties": False}


def test_json_schema_response_format_through_the_cluster(cluster):
    """The grammar travels in the AddRequest message and each instance compiles it (FuDG: on both legs)."""
    strategy, running = cluster
    client = openai.OpenAI(base_url=f"{running.url}/v1", api_key="none", timeout=60, max_retries=0)
    fmt = {"type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA, "strict": True}}
    for seed in range(2):
        r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "A pet?"}],
                                           seed=seed, temperature=1.0, max_tokens=60, response_format=fmt)
        jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}
    with pytest.raises(openai.BadRequestError):  # refused by the frontend, before any instance sees it
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "A pet?"}],
                                       max_tokens=5, response_format=bad)
