"""Server fixtures: a tiny random checkpoint, and a real uvicorn server on a free 127.0.0.1 port."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import uvicorn

from tests.utils import make_tiny_checkpoint, serve_in_thread

MAX_MODEL_LEN = 256
ENGINE_KWARGS = dict(num_threads=1, max_model_len=MAX_MODEL_LEN, num_gpu_blocks=256, max_num_seqs=16,
                     max_num_batched_tokens=512)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    return str(make_tiny_checkpoint(tmp_path_factory.mktemp("server_model") / "tiny", "llama"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class RunningServer:
    url: str
    engine: object  # AsyncEngine
    server: uvicorn.Server
    thread: threading.Thread

    @property
    def llm_engine(self):
        return self.engine.engine

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=20)
        assert not self.thread.is_alive(), "the server did not stop"


def start_server(model: str, max_waiting: int | None = None, app_kwargs: dict | None = None,
                 **overrides) -> RunningServer:
    """The real app on uvicorn in a thread (the engine loop is its own thread, as in `ecoserve serve`).

    `app_kwargs` go to create_app (api_key, metrics_prefix, tool_call_parser); the rest to the engine."""
    from ecoserve.engine.async_engine import AsyncEngine
    from ecoserve.config import EngineArgs
    from ecoserve.engine.llm_engine import LLMEngine
    from ecoserve.server.app import create_app

    engine = AsyncEngine(LLMEngine(EngineArgs(model, **{**ENGINE_KWARGS, **overrides}).create_engine_config()),
                         max_waiting=max_waiting)
    url, server, thread = serve_in_thread(create_app(engine, "tiny", **(app_kwargs or {})))
    return RunningServer(url, engine, server, thread)


@pytest.fixture(scope="module")
def server(tiny_model):
    running = start_server(tiny_model)
    yield running
    running.stop()


def wait_idle(running: RunningServer, timeout: float = 10.0) -> None:
    """Until the engine holds no request and no KV block (freed prefix-cache blocks count as free)."""
    deadline = time.monotonic() + timeout
    engine = running.llm_engine
    while engine.has_unfinished_requests() or engine.scheduler.kv.usage > 0:
        assert time.monotonic() < deadline, (f"engine not idle: {engine.get_num_unfinished_requests()} requests, "
                                             f"KV usage {engine.scheduler.kv.usage}")
        time.sleep(0.02)


def metric(url: str, name: str, **labels: str) -> float:
    """One sample of /metrics (0 when absent)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics").text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return 0.0


def start_cli_server(model: str, *args: str, port: int | None = None) -> tuple[subprocess.Popen, str]:
    """`python -m ecoserve serve` in a subprocess; returns it once /health answers."""
    port = port or free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "ecoserve", "serve", "--model", model, "--port", str(port),
                             "--num-threads", "1", "--uvicorn-log-level", "warning", *args],
                            cwd=Path(__file__).resolve().parents[2], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 90
    while True:
        if proc.poll() is not None:
            raise AssertionError(f"the server exited early:\n{proc.stdout.read()}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "the server did not become healthy"
        time.sleep(0.2)
