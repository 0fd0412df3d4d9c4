"""Launcher `ray`: a real local Ray, two instances as actors, one request served, Ray shut down."""
from __future__ import annotations

import httpx
import pytest

from tests.live.conftest import mock_args, start_strategy, write_profile

ray = pytest.importorskip("ray")


def test_ray_launcher_serves_and_shuts_down(tiny_model, tmp_path):
    profile = write_profile(tmp_path / "profile.csv", [(1, 5.0), (64, 20.0), (512, 80.0)])
    running = start_strategy(tiny_model, "vllm", 2, mock_args(tiny_model, profile), launcher="ray")
    try:
        assert ray.is_initialized()
        instances = running.cluster()
        assert [i["state"] for i in instances] == ["ready", "ready"]
        assert running.engine.opts.auth is not None  # the key set reached the actors in memory
        node_ip = ray.util.get_node_ip_address()
        assert all(h.ready.kv_address.startswith(f"tcp://{node_ip}:") for h in running.engine.board.instances.values())
        r = httpx.post(f"{running.url}/v1/completions", json={"model": "tiny", "prompt": "Hello", "max_tokens": 3},
                       timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    finally:
        running.stop()
    assert not ray.is_initialized()
