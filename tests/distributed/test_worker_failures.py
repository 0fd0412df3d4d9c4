"""A rank that dies or stalls: a clear error naming it within the step deadline, never a hang; then 503.

The killed rank is found by the next request; the stopped one while the engine is idle (its heartbeat).
"""
import multiprocessing
import os
import signal
import time

import httpx
import pytest

from tests.server.conftest import start_server
from tests.utils import make_tiny_checkpoint

STEP_TIMEOUT_S = 3.0


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return str(make_tiny_checkpoint(tmp_path_factory.mktemp("fail") / "llama", num_layers=2))


def complete(url: str) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "Hello there", "max_tokens": 8},
                      timeout=60)


@pytest.mark.parametrize("how,signum,rank,expect", [
    ("killed", signal.SIGKILL, 1, "rank 1 (pipeline stage 1, tensor-parallel rank 0)"),
    ("stopped", signal.SIGSTOP, 0, "rank 0 (pipeline stage 0, tensor-parallel rank 0)"),
])
def test_lost_rank_fails_clearly_and_server_answers_503(model, how, signum, rank, expect):
    running = start_server(model, pipeline_parallel_size=2, step_timeout_s=STEP_TIMEOUT_S)
    pid = next(p.pid for p in multiprocessing.active_children() if p.name == f"ecoserve-rank{rank}")
    try:
        assert complete(running.url).status_code == 200
        os.kill(pid, signum)
        started = time.monotonic()
        if how == "stopped":  # found while idle: /health turns 503 with no request sent
            while httpx.get(f"{running.url}/health", timeout=10).status_code == 200:
                assert time.monotonic() - started < STEP_TIMEOUT_S + 10, "the idle engine missed the stopped rank"
                time.sleep(0.2)
        r = complete(running.url)
        elapsed = time.monotonic() - started
        assert r.status_code == 503, r.text
        message = r.json()["error"]["message"]
        assert expect in message
        assert ("exited unexpectedly" if how == "killed" else "stopped responding") in message
        assert elapsed < STEP_TIMEOUT_S + 10
        health = httpx.get(f"{running.url}/health", timeout=10)
        assert health.status_code == 503 and expect in health.json()["error"]["message"]
        assert not [p for p in multiprocessing.active_children() if p.name.startswith("ecoserve-rank")]  # shut down
    finally:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        running.stop()
