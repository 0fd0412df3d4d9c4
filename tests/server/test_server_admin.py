"""With --api-key every route but /health needs the key (/metrics too unless --metrics-public); the admin
route POST /cluster/scale also needs --enable-admin-api."""
from __future__ import annotations

import httpx
import pytest

from ecoserve.live.routes import cluster_router
from tests.server.conftest import start_server

KEY = "sk-test"
AUTH = {"Authorization": f"Bearer {KEY}"}
SCALE = {"macro": 0, "delta": 1}


class Readout:
    """What the cluster routes read, recording the scale steps they ask for."""

    def __init__(self) -> None:
        self.scaled: list[tuple[int, int]] = []

    @property
    def counters(self) -> dict[str, int]:
        return {"reroutes": 0}

    def views(self) -> list:
        return []

    @property
    def recent_migrations(self) -> list[dict]:
        return []

    def scale_by_hand(self, macro: int, delta: int) -> list[dict]:
        self.scaled.append((macro, delta))
        return [{"action": "add", "macro": macro}]


GUARDED = [("GET", "/v1/models", None), ("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 1}),
           ("POST", "/tokenize", {"prompt": "hi"}), ("POST", "/detokenize", {"tokens": [5]}),
           ("GET", "/version", None), ("GET", "/cluster", None), ("POST", "/cluster/scale", SCALE),
           ("GET", "/openapi.json", None)]


@pytest.fixture(scope="module")
def keyed(tiny_model):
    """A key, the admin API off, /metrics behind the key (the defaults besides the key)."""
    readout = Readout()
    running = start_server(tiny_model, app_kwargs={"api_key": KEY, "routers": [cluster_router(readout)]})
    yield running, readout
    running.stop()


@pytest.fixture(scope="module")
def admin(tiny_model):
    """A key, --enable-admin-api and --metrics-public."""
    readout = Readout()
    running = start_server(tiny_model, app_kwargs={"api_key": KEY, "routers": [cluster_router(readout)],
                                                   "enable_admin_api": True, "metrics_public": True})
    yield running, readout
    running.stop()


@pytest.mark.parametrize("method,path,body", GUARDED + [("GET", "/metrics", None)],
                         ids=[p for _, p, _ in GUARDED] + ["/metrics"])
def test_every_route_but_health_needs_the_key(keyed, method, path, body):
    running, readout = keyed
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = httpx.request(method, running.url + path, json=body, headers=headers, timeout=30)
        assert r.status_code == 401, (path, r.text)
        assert r.json()["error"]["code"] == "invalid_api_key" and r.headers["WWW-Authenticate"] == "Bearer"
    assert readout.scaled == []


def test_health_is_open(keyed):
    running, _ = keyed
    assert httpx.get(f"{running.url}/health").status_code == 200


@pytest.mark.parametrize("method,path,body", [g for g in GUARDED if g[1] != "/cluster/scale"],
                         ids=[p for _, p, _ in GUARDED if p != "/cluster/scale"])
def test_with_the_key_the_routes_answer(keyed, method, path, body):
    running, _ = keyed
    r = httpx.request(method, running.url + path, json=body, headers=AUTH, timeout=60)
    assert r.status_code == 200, (path, r.text)


def test_cluster_scale_needs_the_admin_flag_even_with_the_key(keyed):
    running, readout = keyed
    r = httpx.post(f"{running.url}/cluster/scale", json=SCALE, headers=AUTH)
    assert r.status_code == 403, r.text
    error = r.json()["error"]
    assert "--enable-admin-api" in error["message"] and error["code"] == "admin_api_disabled"
    assert readout.scaled == []
    assert httpx.get(f"{running.url}/metrics", headers=AUTH).status_code == 200


def test_with_the_admin_flag_cluster_scale_runs(admin):
    running, readout = admin
    assert httpx.post(f"{running.url}/cluster/scale", json=SCALE).status_code == 401  # still needs the key
    r = httpx.post(f"{running.url}/cluster/scale", json=SCALE, headers=AUTH)
    assert r.status_code == 200, r.text
    assert r.json() == {"actions": [{"action": "add", "macro": 0}]} and readout.scaled == [(0, 1)]


def test_metrics_public_opens_only_metrics(admin):
    running, _ = admin
    assert httpx.get(f"{running.url}/metrics").status_code == 200
    assert httpx.get(f"{running.url}/cluster").status_code == 401
    assert httpx.post(f"{running.url}/tokenize", json={"prompt": "hi"}).status_code == 401
