"""Structured outputs, tool calls, logit_bias, the API key and the vLLM metrics prefix, through the official client."""
from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest

from tests.server.conftest import metric, start_server, wait_idle

KEY = "sk-test-key"
USER = [{"role": "user", "content": "Describe a pet."}]
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "kind": {"enum": ["cat", "dog"]},
        "tags": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 3},
        "owner": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 5}},
                  "required": ["city"], "additionalProperties": False},
    },
    "required": ["name", "kind", "owner"],
    "additionalProperties": False,
}
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                            "unit": {"enum": ["C", "F"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
PARAMS = {"get_weather": WEATHER, "get_time": TIME}


@pytest.fixture(scope="module")
def server(tiny_model):
    running = start_server(tiny_model, app_kwargs=dict(api_key=KEY, metrics_prefix="vllm",
                                                       tool_call_parser="hermes", metrics_public=True))
    yield running
    running.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=60)


def _schema_format(schema):
    return {"type": "json_schema", "json_schema": {"name": "pet", "schema": schema, "strict": True}}


def test_json_schema_completions_validate_streaming_and_not(client, server):
    r = client.chat.completions.create(model="tiny", messages=USER, n=10, seed=1, temperature=1.0, max_tokens=150,
                                       response_format=_schema_format(SCHEMA))
    texts = [c.message.content for c in r.choices]
    stream = client.chat.completions.create(model="tiny", messages=USER, n=10, seed=100, temperature=1.0,
                                            max_tokens=150, response_format=_schema_format(SCHEMA), stream=True)
    streamed = [""] * 10
    for chunk in stream:
        for c in chunk.choices:
            streamed[c.index] += c.delta.content or ""
    assert len(set(texts + streamed)) > 1  # different seeds, different samples
    for text in texts + streamed:
        jsonschema.validate(json.loads(text), SCHEMA)
    wait_idle(server)


def test_regex_choice_and_json_object_through_the_server(client):
    r = client.completions.create(model="tiny", prompt="Code:", n=6, seed=3, temperature=1.0, max_tokens=30,
                                  extra_body={"guided_regex": r"[A-Z]{2}-[0-9]{3}"})
    assert all(re.fullmatch(r"[A-Z]{2}-[0-9]{3}", c.text) for c in r.choices), [c.text for c in r.choices]
    choices = ["alpha", "beta", "gamma delta"]
    stream = client.completions.create(model="tiny", prompt="Pick:", n=6, seed=4, temperature=1.0, max_tokens=30,
                                       extra_body={"structured_outputs": {"choice": choices}}, stream=True)
    texts = [""] * 6
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.text
    assert all(t in choices for t in texts), texts
    r = client.chat.completions.create(model="tiny", messages=USER, max_tokens=4, temperature=0,
                                       response_format={"type": "json_object"})
    assert r.choices[0].message.content.startswith("{")


def _check_calls(calls, names=None):
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert names is None or call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), PARAMS[call.function.name])


def test_tool_choice_required_and_named(client):
    for seed in range(3):
        r = client.chat.completions.create(model="tiny", messages=USER, tools=TOOLS, tool_choice="required",
                                           seed=seed, temperature=1.0, max_tokens=120, parallel_tool_calls=False)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert len(choice.message.tool_calls) == 1
        _check_calls(choice.message.tool_calls)
    named = {"type": "function", "function": {"name": "get_time"}}
    r = client.chat.completions.create(model="tiny", messages=USER, tools=TOOLS, tool_choice=named, seed=5,
                                       temperature=1.0, max_tokens=60)
    _check_calls(r.choices[0].message.tool_calls, {"get_time"})


def test_tool_calls_stream_as_deltas(client):
    def accumulate(**kw):
        calls: dict[int, dict] = {}
        reasons = []
        for chunk in client.chat.completions.create(model="tiny", messages=USER, tools=TOOLS, stream=True,
                                                    temperature=1.0, max_tokens=120, **kw):
            for c in chunk.choices:
                reasons.append(c.finish_reason)
                for d in c.delta.tool_calls or []:
                    call = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
                    call["id"] = call["id"] or d.id
                    call["name"] += d.function.name or "" if d.function else ""
                    call["arguments"] += (d.function.arguments or "") if d.function else ""
        return list(calls.values()), [r for r in reasons if r]

    calls, reasons = accumulate(tool_choice="required", seed=4)  # a seed whose random calls close within max_tokens
    assert reasons == ["tool_calls"] and calls and all(c["id"] for c in calls)
    for c in calls:
        jsonschema.validate(json.loads(c["arguments"]), PARAMS[c["name"]])
    calls, _ = accumulate(tool_choice={"type": "function", "function": {"name": "get_weather"}}, seed=8)
    assert [c["name"] for c in calls] == ["get_weather"]
    jsonschema.validate(json.loads(calls[0]["arguments"]), WEATHER)


def test_auto_tool_choice_without_calls_is_content_and_history_with_tools(client):
    history = USER + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "12:00"}]
    r = client.chat.completions.create(model="tiny", messages=history, tools=TOOLS, max_tokens=8, temperature=0,
                                       extra_body={"ignore_eos": True})
    choice = r.choices[0]
    assert choice.message.tool_calls is None and choice.message.content and choice.finish_reason == "length"


def test_logit_bias_through_the_server(server, client):
    r = client.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=4, temperature=0,
                                  logit_bias={"77": 100}, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 4
    detok = httpx.post(f"{server.url}/detokenize", json={"tokens": [77] * 4},
                       headers={"Authorization": f"Bearer {KEY}"})
    assert r.choices[0].text == detok.json()["prompt"]


def test_api_key(server, client):
    bad = openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        bad.models.list()
    assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi"})
    assert r.status_code == 401 and "Authorization: Bearer" in r.json()["error"]["message"]
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/metrics").status_code == 200  # --metrics-public
    assert httpx.post(f"{server.url}/detokenize", json={"tokens": [77]}).status_code == 401
    assert client.models.list().data[0].id == "tiny"  # still serving


def test_vllm_metrics_prefix(server, client):
    client.completions.create(model="tiny", prompt=[5, 6], max_tokens=2)
    text = httpx.get(f"{server.url}/metrics").text
    assert "vllm:num_requests_running" in text and "ecoserve:" not in text
    assert metric(server.url, "vllm:generation_tokens_total", model_name="tiny") >= 2
