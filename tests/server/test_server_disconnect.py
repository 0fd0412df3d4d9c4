"""A client that goes away aborts its request: the KV blocks come back and the abort is counted."""
from __future__ import annotations

import time

import httpx
import pytest

from tests.server.conftest import metric, wait_idle

LONG = {"prompt": "Once upon a time", "max_tokens": 200, "ignore_eos": True, "temperature": 0}


def _aborts(url: str) -> float:
    return metric(url, "ecoserve:request_success_total", model_name="tiny", finished_reason="abort")


def _wait_running(server, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not server.llm_engine.scheduler.running:
        assert time.monotonic() < deadline, "the request never started running"
        time.sleep(0.005)


@pytest.fixture
def slow_steps(server, monkeypatch):
    """Make each engine step take >= 20 ms so a 200-token request cannot finish while the client reads."""
    executor = server.llm_engine.executor
    execute = executor.execute

    def slow(*args):  # the batch (and its grammar masks)
        time.sleep(0.02)
        return execute(*args)

    monkeypatch.setattr(executor, "execute", slow)


def test_streaming_client_disconnect_frees_kv_and_counts_abort(server, slow_steps):
    wait_idle(server)
    baseline, aborts = server.llm_engine.scheduler.kv.usage, _aborts(server.url)
    generated = server.llm_engine.stats["generation_tokens"]
    with httpx.Client(timeout=30) as c:
        with c.stream("POST", f"{server.url}/v1/completions", json={**LONG, "stream": True}) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            got = [line for line, _ in zip(lines, range(6)) if line.startswith("data: ")]
            assert got and server.llm_engine.scheduler.kv.usage > baseline
        # leaving the block closes the connection mid-stream
    wait_idle(server)
    assert server.llm_engine.scheduler.kv.usage == baseline
    assert server.llm_engine.stats["generation_tokens"] - generated < 200  # it stopped early
    _wait_aborts(server.url, aborts + 1)


def _wait_aborts(url: str, expected: float) -> None:
    """The abort is counted on the engine thread, possibly after the client has given up."""
    deadline = time.monotonic() + 5
    while _aborts(url) != expected:
        assert time.monotonic() < deadline, "the abort was not counted"
        time.sleep(0.05)


@pytest.mark.parametrize("path,body", [("/v1/completions", LONG),
                                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                                                 "max_tokens": 200, "ignore_eos": True})])
def test_non_streaming_client_disconnect_aborts(server, slow_steps, path, body):
    wait_idle(server)
    aborts = _aborts(server.url)
    with pytest.raises(httpx.ReadTimeout):  # the client gives up while the server is still generating
        httpx.post(f"{server.url}{path}", json={**body, "max_tokens": 240, "n": 4}, timeout=httpx.Timeout(30, read=0.15))
    _wait_aborts(server.url, aborts + 1)
    wait_idle(server)
