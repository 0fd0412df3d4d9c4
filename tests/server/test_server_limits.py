"""Limits that keep one request from hurting the others: bounded fields (400 naming the field), the body
limit (413 before the body is read), the waiting queue (503 + Retry-After), and long prompts refused
without blocking other streams."""
from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from ecoserve.sampling import SEED_MAX, SEED_MIN
from ecoserve.server import protocol as P
from ecoserve.server.body_limit import DEFAULT_MAX_REQUEST_BODY_BYTES
from tests.server.conftest import MAX_MODEL_LEN, start_server, wait_idle
from tests.utils import stream_gaps

CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
USER = [{"role": "user", "content": "Hi"}]
def tool(i: int) -> dict:
    return {"type": "function", "function": {"name": f"f{i}", "parameters": {"type": "object"}}}

# (name, path, body, param named in the error, text in the message): each one past its limit
PAST_LIMITS = [
    ("seed above int64", CMPL, {"prompt": "hi", "seed": SEED_MAX + 1}, "seed", str(SEED_MAX)),
    ("seed 2**64", CMPL, {"prompt": "hi", "seed": 2**64}, "seed", str(SEED_MAX)),
    ("seed below int64", CMPL, {"prompt": "hi", "seed": SEED_MIN - 1}, "seed", str(SEED_MIN)),
    ("n", CMPL, {"prompt": "hi", "n": P.MAX_N + 1}, "n", f"[1, {P.MAX_N}]"),
    ("prompts", CMPL, {"prompt": ["hi"] * (P.MAX_PROMPTS + 1)}, "prompt", str(P.MAX_PROMPTS)),
    ("prompts x n", CMPL, {"prompt": ["hi"] * 100, "n": P.MAX_SAMPLES // 100 + 1}, "n", str(P.MAX_SAMPLES)),
    ("stop count", CMPL, {"prompt": "hi", "stop": [f"s{i}" for i in range(P.MAX_STOP_STRINGS + 1)]}, "stop",
     str(P.MAX_STOP_STRINGS)),
    ("stop length", CMPL, {"prompt": "hi", "stop": "x" * (P.MAX_STOP_STRING_CHARS + 1)}, "stop",
     str(P.MAX_STOP_STRING_CHARS)),
    ("stop_token_ids count", CMPL, {"prompt": "hi", "stop_token_ids": [1] * (P.MAX_STOP_TOKEN_IDS + 1)},
     "stop_token_ids", str(P.MAX_STOP_TOKEN_IDS)),
    ("stop_token_ids value", CMPL, {"prompt": "hi", "stop_token_ids": [2**31]}, "stop_token_ids.0", ""),
    ("logit_bias size", CMPL, {"prompt": "hi", "logit_bias": {str(i): 1 for i in range(P.MAX_LOGIT_BIAS + 1)}},
     "logit_bias", str(P.MAX_LOGIT_BIAS)),
    ("logit_bias key digits", CMPL, {"prompt": "hi", "logit_bias": {"9" * 5000: 1}}, "logit_bias", "token ids"),
    ("top_k", CMPL, {"prompt": "hi", "top_k": 2**31}, "top_k", str(2**31 - 1)),
    ("max_tokens vs max_model_len", CMPL, {"prompt": "hi", "max_tokens": MAX_MODEL_LEN}, "max_tokens",
     str(MAX_MODEL_LEN)),
    ("min_tokens vs max_model_len", CHAT, {"messages": USER, "min_tokens": 10**30}, "min_tokens", ""),
    ("chat max_completion_tokens", CHAT, {"messages": USER, "max_completion_tokens": MAX_MODEL_LEN},
     "max_completion_tokens", str(MAX_MODEL_LEN)),
    ("messages", CHAT, {"messages": USER * (P.MAX_MESSAGES + 1)}, "messages", str(P.MAX_MESSAGES)),
    ("tools", CHAT, {"messages": USER, "tools": [tool(i) for i in range(P.MAX_TOOLS + 1)]}, "tools", str(P.MAX_TOOLS)),
    ("guided_regex", CMPL, {"prompt": "hi", "guided_regex": "a" * (P.MAX_GRAMMAR_CHARS + 1)}, "guided_regex",
     str(P.MAX_GRAMMAR_CHARS)),
    ("guided_grammar", CMPL, {"prompt": "hi", "guided_grammar": "a" * (P.MAX_GRAMMAR_CHARS + 1)},
     "guided_grammar", str(P.MAX_GRAMMAR_CHARS)),
    ("guided_choice", CMPL, {"prompt": "hi", "guided_choice": ["a" * 1000] * (P.MAX_GRAMMAR_CHARS // 1000 + 1)},
     "guided_choice", str(P.MAX_GRAMMAR_CHARS)),
    ("json schema", CHAT, {"messages": USER, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "description": "d" * P.MAX_GRAMMAR_CHARS}}}},
     "response_format", str(P.MAX_GRAMMAR_CHARS)),
]


@pytest.fixture(scope="module")
def server(tiny_model):
    running = start_server(tiny_model)
    yield running
    running.stop()


@pytest.mark.parametrize("name,path,body,param,text", PAST_LIMITS, ids=[c[0] for c in PAST_LIMITS])
def test_each_field_past_its_limit_is_a_400_naming_it(server, name, path, body, param, text):
    r = httpx.post(server.url + path, json=body, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and text in error["message"], error
    assert error["type"] == "invalid_request_error"


@pytest.mark.parametrize("seed", [SEED_MIN, -1, SEED_MAX])
def test_seeds_at_the_edges_of_int64_are_served(server, seed):
    body = {"prompt": "hi", "seed": seed, "temperature": 1.0, "max_tokens": 3, "n": 2}
    first = httpx.post(f"{server.url}{CMPL}", json=body, timeout=60)
    assert first.status_code == 200, first.text
    again = httpx.post(f"{server.url}{CMPL}", json=body, timeout=60).json()
    assert [c["text"] for c in again["choices"]] == [c["text"] for c in first.json()["choices"]]


def test_limits_at_their_bounds_are_accepted(server):
    body = {"prompt": ["hi"] * 4, "stop": ["x" * P.MAX_STOP_STRING_CHARS] * P.MAX_STOP_STRINGS, "max_tokens": 2,
            "stop_token_ids": [1] * P.MAX_STOP_TOKEN_IDS, "logit_bias": {str(i): 1 for i in range(500)}}
    r = httpx.post(f"{server.url}{CMPL}", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 4
    r = httpx.post(f"{server.url}{CHAT}", json={"messages": USER, "max_tokens": 2,
                                                "tools": [tool(i) for i in range(P.MAX_TOOLS)], "tool_choice": "none"}, timeout=60)
    assert r.status_code == 200, r.text


def test_a_50_mb_tokenize_body_gets_413_at_once(server):
    t0 = time.monotonic()
    r = httpx.post(f"{server.url}/tokenize", content=b"x" * (50 * 2**20),
                   headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 413, r.text
    assert time.monotonic() - t0 < 10
    error = r.json()["error"]
    assert error["code"] == "request_too_large" and str(DEFAULT_MAX_REQUEST_BODY_BYTES) in error["message"]
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_a_chunked_body_is_cut_off_once_past_the_limit(server):
    """No Content-Length: the middleware counts the chunks and answers 413 before the rest arrives."""
    sent = 0

    def chunks():
        nonlocal sent
        for _ in range(64):  # up to 64 MiB, far more than the limit
            sent += 2**20
            yield b" " * 2**20

    r = httpx.post(f"{server.url}/v1/completions", content=chunks(), headers={"content-type": "application/json"},
                   timeout=30)
    assert r.status_code == 413, r.text
    assert r.json()["error"]["code"] == "request_too_large"
    r = httpx.post(f"{server.url}{CMPL}", json={"prompt": "hi", "max_tokens": 2}, timeout=30)
    assert r.status_code == 200


def test_a_body_under_the_limit_is_read_whole(server):
    """A large but allowed body (a long /tokenize text, off the event loop) is served."""
    text = "hello world " * 100_000  # 1.2 MB
    r = httpx.post(f"{server.url}/tokenize", json={"prompt": text}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["count"] > MAX_MODEL_LEN



def test_a_10x_prompt_is_refused_without_blocking_other_streams(server):
    """Prompts far past the context (tokenized with truncation, or refused by length before tokenizing) get
    their 400 while a running stream's inter-token gaps stay bounded."""
    url = server.url
    ten_x = "word " * (2 * MAX_MODEL_LEN)  # 10x max_model_len characters, more tokens than the context
    long_texts = [ten_x, "z" * (server_max_chars(server) + 1)]  # the second is refused by its length alone

    async def run() -> tuple[list[float], list[httpx.Response]]:
        started = asyncio.Event()
        stream = asyncio.create_task(stream_gaps(url, started))
        await asyncio.wait_for(started.wait(), 60)
        answers = []
        async with httpx.AsyncClient(timeout=120) as client:
            for _ in range(200):  # bounded: until the stream ends
                for text in long_texts:
                    answers.append(await client.post(f"{url}{CMPL}", json={"prompt": text, "max_tokens": 2}))
                    answers.append(await client.post(f"{url}{CHAT}", json={
                        "messages": [{"role": "user", "content": text}], "max_tokens": 2}))
                if stream.done():
                    break
        return await stream, answers

    gaps, answers = asyncio.run(run())
    assert len(answers) >= 8  # several rounds of long prompts overlapped the stream
    for r in answers:
        assert r.status_code == 400, r.text
        assert r.json()["error"]["code"] == "context_length_exceeded"
    messages = [r.json()["error"]["message"] for r in answers]
    assert any("characters" in m for m in messages) and any(f"more than {MAX_MODEL_LEN} tokens" in m
                                                            for m in messages)
    assert len(gaps) >= 20 and max(gaps) < 2.0, max(gaps)
    wait_idle(server)


def server_max_chars(server) -> int:
    """The text length past which the running server refuses a prompt before tokenizing it."""
    from fastapi import FastAPI

    app: FastAPI = server.server.config.app
    return app.state.server.max_prompt_chars


def test_overload_gives_503_with_retry_after(tiny_model):
    """--max-waiting-requests 1: requests past a full waiting queue get 503 + Retry-After at once."""
    running = start_server(tiny_model, max_waiting=1, max_num_seqs=1)
    try:
        body = {"prompt": "busy", "max_tokens": 40, "temperature": 0, "ignore_eos": True}

        async def burst() -> list[tuple[httpx.Response, float]]:
            async with httpx.AsyncClient(timeout=120) as client:
                async def one():
                    t0 = time.monotonic()
                    r = await client.post(f"{running.url}{CMPL}", json=body)
                    return r, time.monotonic() - t0
                return await asyncio.gather(*(one() for _ in range(6)))

        results = asyncio.run(burst())
        refused = [(r, t) for r, t in results if r.status_code == 503]
        served = [r for r, _ in results if r.status_code == 200]
        assert refused and served and len(refused) + len(served) == 6, [r.text for r, _ in results]
        for r, elapsed in refused:
            assert int(r.headers["Retry-After"]) >= 1 and elapsed < 10
            error = r.json()["error"]
            assert error["code"] == "queue_full" and error["type"] == "service_unavailable"
        assert httpx.post(f"{running.url}{CMPL}", json={**body, "max_tokens": 2}).status_code == 200
    finally:
        running.stop()


def test_the_cluster_frontends_overload_maps_to_503_too():
    """ClusterEngine.generate raises the engine's EngineOverloadedError; the server answers it alike."""
    from ecoserve.engine.async_engine import EngineOverloadedError
    from ecoserve.server.serving import engine_error

    error = engine_error(EngineOverloadedError("the waiting queue is full (4 requests); retry later"))
    assert error.status == 503 and error.headers == {"Retry-After": "1"} and error.code == "queue_full"
    assert json.loads(error.response().body)["error"]["type"] == "service_unavailable"


def test_tokenizer_work_runs_on_the_tokenizer_pool(server):
    """encode, decode and the chat template of whole texts run on the pool's threads, never the event loop's."""
    import threading

    tokenizer = server.engine.model.tokenizer
    threads: dict[str, set[str]] = {"encode": set(), "decode": set(), "apply_chat_template": set()}
    on_loop: list[str] = []
    originals = {name: getattr(tokenizer, name) for name in threads}

    def recording(name):
        def call(*args, **kwargs):
            threads[name].add(threading.current_thread().name)
            try:
                asyncio.get_running_loop()
                on_loop.append(name)
            except RuntimeError:  # no loop in this thread: the pool (or the engine's own thread)
                pass
            return originals[name](*args, **kwargs)
        return call

    for name in threads:
        setattr(tokenizer, name, recording(name))
    try:
        for path, body in [(CMPL, {"prompt": "hello", "max_tokens": 2}),
                           (CMPL, {"prompt": [5, 6, 7], "max_tokens": 2, "echo": True}),
                           (CHAT, {"messages": USER, "max_tokens": 2}),
                           ("/tokenize", {"prompt": "hello"}), ("/tokenize", {"messages": USER}),
                           ("/detokenize", {"tokens": [5, 6, 7]})]:
            r = httpx.post(server.url + path, json=body, timeout=60)
            assert r.status_code == 200, (path, r.text)
    finally:
        for name in threads:
            delattr(tokenizer, name)
    assert not on_loop, on_loop
    for name, seen in threads.items():
        assert any(t.startswith("ecoserve-tokenizer") for t in seen), (name, seen)
