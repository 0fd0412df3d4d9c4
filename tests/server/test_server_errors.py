"""Malformed requests get a 4xx in OpenAI's error shape, and the server keeps answering correctly."""
from __future__ import annotations

import httpx
import pytest

from tests.server.conftest import MAX_MODEL_LEN, wait_idle

CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
USER = [{"role": "user", "content": "Hi"}]
LONG = [7] * (MAX_MODEL_LEN + 1)

# (name, path, body (raw bytes or JSON), status, param named in the error or None, text in the message)
CASES = [
    ("bad json", CMPL, b'{"prompt": "hi", ', 400, None, "not valid JSON"),
    ("not an object", CMPL, b"[1, 2]", 400, None, ""),
    ("empty body", CMPL, b"", 400, None, "not valid JSON"),
    ("missing prompt", CMPL, {"max_tokens": 2}, 400, "prompt", "missing"),
    ("prompt wrong type", CMPL, {"prompt": 5}, 400, "prompt", ""),
    ("max_tokens a string", CMPL, {"prompt": "hi", "max_tokens": "ten"}, 400, "max_tokens", "ten"),
    ("stream a string", CMPL, {"prompt": "hi", "stream": "yes"}, 400, "stream", ""),
    ("temperature -1", CMPL, {"prompt": "hi", "temperature": -1}, 400, "temperature", ">= 0"),
    ("temperature a string", CMPL, {"prompt": "hi", "temperature": "hot"}, 400, "temperature", ""),
    ("top_p 2", CMPL, {"prompt": "hi", "top_p": 2}, 400, "top_p", "(0, 1]"),
    ("top_p 0", CMPL, {"prompt": "hi", "top_p": 0}, 400, "top_p", "(0, 1]"),
    ("max_tokens 0", CMPL, {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens", ">= 1"),
    ("max_tokens -5", CMPL, {"prompt": "hi", "max_tokens": -5}, 400, "max_tokens", ">= 1"),
    ("n 0", CMPL, {"prompt": "hi", "n": 0}, 400, "n", "[1, 128]"),
    ("n 200", CMPL, {"prompt": "hi", "n": 200}, 400, "n", "n must be in [1, 128], got 200"),
    ("stop_token_ids -1", CMPL, {"prompt": "hi", "stop_token_ids": [-1]}, 400, "stop_token_ids.0", ""),
    ("chat: top_logprobs 30", CHAT, {"messages": USER, "logprobs": True, "top_logprobs": 30}, 400, "top_logprobs",
     "[0, 20]"),
    ("chat: max_completion_tokens 0", CHAT, {"messages": USER, "max_completion_tokens": 0}, 400,
     "max_completion_tokens", ">= 1"),
    ("logprobs 50", CMPL, {"prompt": "hi", "logprobs": 50}, 400, "logprobs", "[0, 20]"),
    ("presence_penalty 3", CMPL, {"prompt": "hi", "presence_penalty": 3}, 400, "presence_penalty", "[-2, 2]"),
    ("top_k -2", CMPL, {"prompt": "hi", "top_k": -2}, 400, "top_k", ""),
    ("min_p 1.5", CMPL, {"prompt": "hi", "min_p": 1.5}, 400, "min_p", "[0, 1]"),
    ("min_tokens > max_tokens", CMPL, {"prompt": "hi", "max_tokens": 2, "min_tokens": 5}, 400, "min_tokens", ""),
    ("empty stop string", CMPL, {"prompt": "hi", "stop": [""]}, 400, "stop", ""),
    ("empty prompt", CMPL, {"prompt": ""}, 400, "prompt", "empty"),
    ("empty token list", CMPL, {"prompt": []}, 400, "prompt", "empty"),
    ("token id out of vocab", CMPL, {"prompt": [1, 10**6]}, 400, None, "1000000"),
    ("prompt over the context", CMPL, {"prompt": LONG, "max_tokens": 1}, 400, "prompt",
     f"{MAX_MODEL_LEN} tokens, but the prompt has {MAX_MODEL_LEN + 1}"),
    ("prompt + max_tokens over the context", CMPL, {"prompt": [7] * 200, "max_tokens": 100}, 400, "max_tokens",
     "300"),
    ("stream_options without stream", CMPL, {"prompt": "hi", "stream_options": {"include_usage": True}}, 400,
     "stream_options", ""),
    ("logit_bias out of range", CMPL, {"prompt": "hi", "logit_bias": {"5": 101}}, 400, "logit_bias", "[-100, 100]"),
    ("logit_bias not a token id", CMPL, {"prompt": "hi", "logit_bias": {"x": 1}}, 400, "logit_bias", "token ids"),
    ("logit_bias token past the vocab", CMPL, {"prompt": "hi", "logit_bias": {"99999": 1}}, 400, None,
     "logit_bias token ids must be in"),
    ("unknown model", CMPL, {"model": "gpt-9", "prompt": "hi"}, 404, "model", "gpt-9"),
    ("chat: empty messages", CHAT, {"messages": []}, 400, "messages", ""),
    ("chat: missing messages", CHAT, {"max_tokens": 2}, 400, "messages", "missing"),
    ("chat: unknown role", CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages.0.role", ""),
    ("chat: content a number", CHAT, {"messages": [{"role": "user", "content": 5}]}, 400, "messages.0.content", ""),
    ("chat: image part", CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     400, "messages.0.content", ""),
    ("chat: top_logprobs without logprobs", CHAT, {"messages": USER, "top_logprobs": 2}, 400, "top_logprobs", ""),
    ("chat: logprobs not a bool", CHAT, {"messages": USER, "logprobs": "yes"}, 400, "logprobs", ""),
    ("chat: tool without a function", CHAT, {"messages": USER, "tools": [{"type": "function"}]}, 400,
     "tools.0.function", "missing"),
    ("chat: too long", CHAT, {"messages": [{"role": "user", "content": "hi " * 400}]}, 400, "messages",
     f"{MAX_MODEL_LEN} tokens"),
    ("chat: invalid json schema", CHAT, {"messages": USER, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}}, 400, "response_format",
     "objectx"),
    ("bad response_format type", CHAT, {"messages": USER, "response_format": {"type": "yaml"}}, 400,
     "response_format", "json_schema"),
    ("invalid guided_regex", CMPL, {"prompt": "hi", "guided_regex": "a(b"}, 400, "guided_regex", "regex"),
    ("two constraints", CMPL, {"prompt": "hi", "guided_regex": "a", "guided_choice": ["b"]}, 400, "guided_choice",
     "at most one"),
    ("unknown structured_outputs key", CMPL, {"prompt": "hi", "structured_outputs": {"yaml": "x"}}, 400,
     "structured_outputs", "yaml"),
    ("chat: unknown tool type", CHAT, {"messages": USER, "tools": [{"type": "retrieval", "function": {"name": "f"}}],
                                       "tool_choice": "required"}, 400, "tools.0.type", "'function'"),
    ("chat: tool_choice names a missing function", CHAT, {
        "messages": USER, "tools": [{"type": "function", "function": {"name": "f"}}],
        "tool_choice": {"type": "function", "function": {"name": "g"}}}, 400, "tool_choice", "'g'"),
    ("chat: tool_choice auto without a parser", CHAT, {
        "messages": USER, "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tool_choice",
     "--tool-call-parser"),
    ("chat: invalid tool parameters schema", CHAT, {
        "messages": USER, "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objectx"}}}],
        "tool_choice": "required"}, 400, "tools", "objectx"),
    ("chat: unknown model", CHAT, {"model": "nope", "messages": USER}, 404, "model", "nope"),
    ("tokenize: neither prompt nor messages", "/tokenize", {}, 400, "prompt", ""),
    ("detokenize: bad id", "/detokenize", {"tokens": [-1]}, 400, "tokens", ""),
    ("unknown route", "/v1/nothing", {}, 404, None, "/v1/nothing"),
]


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=30) as c:
        yield c


def _valid(http: httpx.Client) -> None:
    r = http.post(CMPL, json={"prompt": [5, 6, 7], "max_tokens": 2, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}


@pytest.mark.parametrize("name,path,body,status,param,text", CASES, ids=[c[0] for c in CASES])
def test_malformed_request_gets_openai_error(http, name, path, body, status, param, text):
    if isinstance(body, bytes):
        r = http.post(path, content=body, headers={"content-type": "application/json"})
    else:
        r = http.post(path, json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"], error
    assert error["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
    if param is not None:
        assert error["param"] == param, error
    assert text in error["message"], error
    _valid(http)  # the server is unharmed


def test_wrong_method_and_errors_leave_no_request_behind(server, http):
    r = http.get(CMPL)
    assert r.status_code == 405 and "error" in r.json()
    wait_idle(server)  # nothing queued by any of the refused requests


def test_openai_client_raises_typed_errors(server):
    import openai

    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="hi", temperature=-1)
    assert e.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-9", messages=USER)


def test_openapi_declares_what_is_accepted(http):
    spec = http.get("/openapi.json").json()
    body = spec["paths"][CMPL]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body == {"$ref": "#/components/schemas/CompletionRequest"}
    props = spec["components"]["schemas"]["CompletionRequest"]["properties"]
    assert {"minimum": 0, "type": "number"} in props["temperature"]["anyOf"]
    assert {"exclusiveMinimum": 0, "maximum": 1, "type": "number"} in props["top_p"]["anyOf"]
    assert (props["n"]["minimum"], props["n"]["maximum"]) == (1, 128)
    chat = spec["components"]["schemas"]["ChatCompletionRequest"]
    assert "messages" in chat["required"] and "ChatMessage" in spec["components"]["schemas"]


def test_declared_ranges_are_no_looser_than_sampling_params():
    """Whatever the schema lets through at its bounds, SamplingParams accepts too."""
    import annotated_types

    from ecoserve.sampling import SamplingParams
    from ecoserve.server.protocol import CompletionRequest

    checked = 0
    for name, info in CompletionRequest.model_fields.items():
        if name not in SamplingParams.__dataclass_fields__:
            continue
        for m in info.metadata:
            if isinstance(m, (annotated_types.Ge, annotated_types.Le)):
                value = m.ge if isinstance(m, annotated_types.Ge) else m.le
            elif isinstance(m, annotated_types.Gt):
                value = m.gt + 1e-3
            else:
                continue
            SamplingParams(**{name: value, "max_tokens": 16 if name != "max_tokens" else value})
            checked += 1
    assert checked >= 10
