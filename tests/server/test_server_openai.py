"""The official `openai` client against a real uvicorn server serving a tiny random model."""
from __future__ import annotations

import httpx
import openai
import pytest

from ecoserve.engine.llm import LLM
from ecoserve.sampling import SamplingParams
from tests.server.conftest import ENGINE_KWARGS, metric, wait_idle
from tests.utils import prompts

PROMPTS = prompts(4, seed=3, min_len=4, max_len=24)


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def offline(tiny_model) -> LLM:
    return LLM(tiny_model, **ENGINE_KWARGS)


def test_greedy_completions_equal_offline_generate(client, offline):
    params = SamplingParams(temperature=0.0, max_tokens=12)
    # one prompt at a time, as the server gets them: the same batch shapes give bitwise-equal logits
    expected = [offline.generate([ids], params, use_tqdm=False)[0] for ids in PROMPTS]
    for ids, exp in zip(PROMPTS, expected):
        r = client.completions.create(model="tiny", prompt=ids, max_tokens=12, temperature=0)
        choice = r.choices[0]
        assert choice.text == exp.outputs[0].text
        assert choice.finish_reason == exp.outputs[0].finish_reason
        assert r.usage.prompt_tokens == len(ids)
        assert r.usage.completion_tokens == len(exp.outputs[0].token_ids)
        assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_greedy_chat_equals_offline_chat(client, offline):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Where is Paris?"}]
    exp = offline.chat(messages, SamplingParams(temperature=0.0, max_tokens=10), use_tqdm=False)[0]
    r = client.chat.completions.create(model="tiny", messages=messages, max_completion_tokens=10, temperature=0)
    assert r.object == "chat.completion" and r.model == "tiny"
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == exp.outputs[0].text
    assert r.usage.prompt_tokens == len(exp.prompt_token_ids)
    assert r.usage.completion_tokens == len(exp.outputs[0].token_ids)


def test_streaming_matches_non_streaming_and_reports_usage(client):
    kwargs = dict(model="tiny", prompt="The quick brown fox", max_tokens=16, temperature=0, extra_body={"ignore_eos": True})
    full = client.completions.create(**kwargs)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])

    messages = [{"role": "user", "content": "Hello there"}]
    full = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0)
    stream = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert stream[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == full.choices[0].message.content
    assert stream[-1].usage.total_tokens == full.usage.total_tokens


def test_raw_sse_ends_with_done(server):
    with httpx.stream("POST", f"{server.url}/v1/completions", timeout=30,
                      json={"prompt": "Hello", "max_tokens": 4, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines) and lines[-1] == "data: [DONE]"


def test_n_and_seed(client):
    r = client.completions.create(model="tiny", prompt="Once upon a time", n=3, max_tokens=8, temperature=1.0,
                                  seed=7, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert r.usage.completion_tokens == 24
    again = client.completions.create(model="tiny", prompt="Once upon a time", n=3, max_tokens=8, temperature=1.0,
                                      seed=7, extra_body={"ignore_eos": True})
    assert [c.text for c in again.choices] == [c.text for c in r.choices]  # seeded: reproducible
    chunks = list(client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], n=2,
                                                 max_tokens=6, stream=True, extra_body={"ignore_eos": True}))
    finished = {ch.index for c in chunks for ch in c.choices if ch.finish_reason}
    assert finished == {0, 1}


def test_batch_of_prompts(client):
    r = client.completions.create(model="tiny", prompt=PROMPTS[:2], n=2, max_tokens=3, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]
    assert r.usage.prompt_tokens == len(PROMPTS[0]) + len(PROMPTS[1]) and r.usage.completion_tokens == 12


def test_stop_string(client):
    base = client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=16, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = next(base[i:i + 2] for i in range(3, len(base) - 2) if base[i:i + 2].strip() and "\ufffd" not in base[i:i + 2])
    for stream in (False, True):
        r = client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=16, temperature=0, stop=[stop],
                                      stream=stream, extra_body={"ignore_eos": True})
        if stream:
            chunks = list(r)
            text, reason = "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason
        else:
            text, reason = r.choices[0].text, r.choices[0].finish_reason
        assert text == base[:base.index(stop)] and reason == "stop"


def test_logprobs(client):
    r = client.completions.create(model="tiny", prompt="Hello", max_tokens=5, temperature=0, logprobs=2,
                                  extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    if "\ufffd" not in r.choices[0].text:  # tokens holding part of a UTF-8 character decode alone to U+FFFD
        assert "".join(lp.tokens) == r.choices[0].text
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        # top-2 keyed by token text: two partial-character tokens may share the key U+FFFD
        assert 1 <= len(top) <= 2 and chosen == pytest.approx(max(top.values()))  # greedy takes the most likely
    echo = client.completions.create(model="tiny", prompt="Hello world", max_tokens=2, temperature=0, echo=True,
                                     logprobs=1, extra_body={"ignore_eos": True})
    assert echo.choices[0].text.startswith("Hello world")
    assert echo.choices[0].logprobs.token_logprobs[0] is None  # the first prompt token has no logprob
    assert len(echo.choices[0].logprobs.tokens) == echo.usage.prompt_tokens + 2

    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                          temperature=0, logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens == 4
    if "\ufffd" not in chat.choices[0].message.content:
        assert "".join(c.token for c in content) == chat.choices[0].message.content
    for item in content:
        assert len(item.top_logprobs) == 3 and item.logprob == pytest.approx(item.top_logprobs[0].logprob)
        assert bytes(item.bytes).decode() == item.token
    streamed = list(client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                                   max_tokens=4, temperature=0, logprobs=True, top_logprobs=1,
                                                   stream=True, extra_body={"ignore_eos": True}))
    tokens = [c.token for ch in streamed if ch.choices and ch.choices[0].logprobs for c in ch.choices[0].logprobs.content]
    assert tokens == [c.token for c in content]


def test_sampling_extensions_are_accepted(client):
    r = client.completions.create(model="tiny", prompt="Hello", max_tokens=6, temperature=0.8, top_p=0.9,
                                  presence_penalty=0.5, frequency_penalty=0.5, seed=1,
                                  extra_body={"top_k": 5, "min_p": 0.05, "min_tokens": 6, "repetition_penalty": 1.1})
    assert r.usage.completion_tokens == 6  # min_tokens == max_tokens: EOS cannot end it early


def test_models_tokenize_detokenize_health(server, client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert client.models.retrieve("tiny").id == "tiny"
    assert httpx.get(f"{server.url}/health").status_code == 200
    tok = httpx.post(f"{server.url}/tokenize", json={"prompt": "Hello world"}).json()
    assert tok["count"] == len(tok["tokens"]) > 0 and tok["max_model_len"] == server.llm_engine.max_model_len
    assert httpx.post(f"{server.url}/detokenize", json={"tokens": tok["tokens"]}).json()["prompt"].endswith("Hello world")
    chat = httpx.post(f"{server.url}/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]}).json()
    r = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                              "max_tokens": 1}).json()
    assert chat["count"] == r["usage"]["prompt_tokens"]


def test_metrics(server, client):
    names = ["ecoserve:num_requests_running", "ecoserve:num_requests_waiting", "ecoserve:kv_cache_usage_perc",
             "ecoserve:prefix_cache_queries_total", "ecoserve:prefix_cache_hits_total",
             "ecoserve:prompt_tokens_total", "ecoserve:generation_tokens_total", "ecoserve:num_preemptions_total"]
    before = {n: metric(server.url, n, model_name="tiny") for n in names}
    ok_before = metric(server.url, "ecoserve:request_success_total", model_name="tiny", finished_reason="length")
    hist = ["time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
            "request_queue_time_seconds"]
    counts = {h: metric(server.url, f"ecoserve:{h}_count", model_name="tiny") for h in hist}
    r = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=5, temperature=0,
                                  extra_body={"ignore_eos": True})
    wait_idle(server)
    after = {n: metric(server.url, n, model_name="tiny") for n in names}
    assert after["ecoserve:prompt_tokens_total"] - before["ecoserve:prompt_tokens_total"] == r.usage.prompt_tokens
    assert after["ecoserve:generation_tokens_total"] - before["ecoserve:generation_tokens_total"] == 5
    assert after["ecoserve:prefix_cache_queries_total"] > before["ecoserve:prefix_cache_queries_total"]
    assert after["ecoserve:num_requests_running"] == after["ecoserve:num_requests_waiting"] == 0
    assert after["ecoserve:kv_cache_usage_perc"] == 0.0
    assert metric(server.url, "ecoserve:request_success_total", model_name="tiny",
                  finished_reason="length") == ok_before + 1
    for h in hist:
        expected = 4 if h == "inter_token_latency_seconds" else 1
        assert metric(server.url, f"ecoserve:{h}_count", model_name="tiny") - counts[h] == expected, h
