"""`ecoserve serve` as a process: overload refusals with Retry-After, and a SIGTERM that does not hang."""
from __future__ import annotations

import asyncio
import json
import signal
import time

import httpx
import pytest

from tests.server.conftest import start_cli_server

BODY = {"prompt": "Once upon a time", "max_tokens": 150, "ignore_eos": True, "temperature": 0}


@pytest.fixture(scope="module")
def cli_server(tiny_model):
    proc, url = start_cli_server(tiny_model, "--served-model-name", "tiny", "--max-num-seqs", "2",
                                 "--max-waiting-requests", "2", "--max-model-len", "256",
                                 "--kv-cache-memory-bytes", str(4 << 20), "--shutdown-timeout", "0.5")
    yield proc, url
    if proc.poll() is None:
        proc.kill()
        proc.wait(timeout=10)


def test_overload_is_refused_quickly_and_the_rest_complete(cli_server):
    _, url = cli_server

    async def one(client: httpx.AsyncClient) -> tuple[int, float, httpx.Response]:
        t0 = time.monotonic()
        r = await client.post(f"{url}/v1/completions", json=BODY)
        return r.status_code, time.monotonic() - t0, r

    async def burst() -> list[tuple[int, float, httpx.Response]]:
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(*(one(client) for _ in range(12)))

    results = asyncio.run(burst())
    refused = [(t, r) for status, t, r in results if status == 503]
    done = [r for status, _, r in results if status == 200]
    assert len(refused) + len(done) == 12, [r.text for _, _, r in results]
    assert refused and len(done) >= 2  # at least the two that fit in the waiting queue
    for elapsed, r in refused:
        assert elapsed < 5 and int(r.headers["Retry-After"]) >= 1
        assert r.json()["error"]["code"] == "queue_full" and r.json()["error"]["type"] == "service_unavailable"
    assert all(r.json()["usage"]["completion_tokens"] == 150 for r in done)
    assert httpx.post(f"{url}/v1/completions", json={**BODY, "max_tokens": 2}).status_code == 200  # recovered


def test_sigterm_fails_in_flight_stream_cleanly_and_exits(cli_server):
    proc, url = cli_server
    events: list[str] = []
    with httpx.Client(timeout=30) as client:
        with client.stream("POST", f"{url}/v1/completions",
                           json={**BODY, "max_tokens": 240, "n": 2, "stream": True}) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            events.append(next(line for line in lines if line.startswith("data: ")))
            t0 = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            events += [line for line in lines if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    last = json.loads(events[-2][len("data: "):])
    # within the grace period it finished, or it got an error event saying why it stopped
    assert "error" in last and "shutting down" in last["error"]["message"] or \
        last["choices"][-1]["finish_reason"] == "length"
    # uvicorn re-raises the captured signal once its graceful shutdown is done, so the parent sees SIGTERM
    assert proc.wait(timeout=20) in (0, -signal.SIGTERM)
    assert time.monotonic() - t0 < 15
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{url}/health", timeout=2)
