"""LoRA adapters over a live cluster (two mock instances, the real frontend, protocol and router): runtime
load/unload through the official `openai` client's HTTP, adapters chosen by `model`, /v1/models, the API key,
adapters loaded on demand by the instance a request reaches, and requests for an adapter routed to the
instance that holds it."""
from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.live.conftest import mock_args, start_strategy, wait_until, write_profile

KEY = "sk-lora-test"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROFILE = [(1, 4.0), (16, 6.0), (64, 10.0), (256, 30.0)]


def _adapter(folder) -> str:
    """A PEFT checkpoint folder as the frontend checks it (mock instances load nothing)."""
    folder.mkdir()
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8, "lora_alpha": 16,
                                                            "target_modules": ["q_proj", "v_proj"]}))
    return str(folder)


@pytest.fixture(scope="module")
def running(tiny_model, tmp_path_factory):
    profile = write_profile(tmp_path_factory.mktemp("lora_mock") / "profile.csv", PROFILE)
    cluster = start_strategy(tiny_model, "vllm", 2, mock_args(tiny_model, profile), ttft_slo=2.0, tpot_slo=0.5,
                             app_kwargs={"api_key": KEY, "enable_lora": True, "allow_runtime_lora_updating": True})
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("adapters")
    return {name: _adapter(root / name) for name in ("x", "y")}


def _client(running) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{running.url}/v1", api_key=KEY, max_retries=0, timeout=60)


def _instances(running) -> list[dict]:
    return httpx.get(f"{running.url}/cluster", headers=AUTH, timeout=10).json()["instances"]


def _load(running, name: str, path: str) -> httpx.Response:
    return httpx.post(f"{running.url}/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path},
                      headers=AUTH, timeout=30)


def test_runtime_load_serve_list_and_unload(running, adapters):
    client = _client(running)
    r = _load(running, "x", adapters["x"])
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'x' added successfully."
    assert _load(running, "x", adapters["x"]).status_code == 400  # already loaded
    cards = {m.id: m for m in client.models.list().data}
    assert set(cards) == {"tiny", "x"}
    assert cards["x"].model_extra["parent"] == "tiny" and cards["x"].model_extra["root"] == adapters["x"]
    out = client.completions.create(model="x", prompt="hello there", max_tokens=4, temperature=0)
    assert out.model == "x" and out.usage.completion_tokens == 4
    chat = client.chat.completions.create(model="x", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    assert chat.model == "x"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="hello", max_tokens=2)
    r = httpx.post(f"{running.url}/v1/unload_lora_adapter", json={"lora_name": "x"}, headers=AUTH, timeout=30)
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'x' removed successfully."
    assert {m.id for m in client.models.list().data} == {"tiny"}
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="x", prompt="hello", max_tokens=2)
    r = httpx.post(f"{running.url}/v1/unload_lora_adapter", json={"lora_name": "x"}, headers=AUTH, timeout=30)
    assert r.status_code == 404
    assert client.completions.create(model="tiny", prompt="hello", max_tokens=2).usage.completion_tokens == 2


def test_bad_adapters_are_a_400_and_the_server_keeps_serving(running, tmp_path):
    r = _load(running, "missing", str(tmp_path / "nowhere"))
    assert r.status_code == 400 and "no adapter found" in r.json()["error"]["message"]
    assert httpx.post(f"{running.url}/v1/load_lora_adapter", json={"lora_name": "z"}, headers=AUTH,
                      timeout=30).status_code == 400  # lora_path missing
    assert _load(running, "tiny", str(tmp_path)).status_code == 400  # the base model's name
    assert _client(running).completions.create(model="tiny", prompt="hi", max_tokens=2).usage.completion_tokens == 2


def test_the_routes_need_the_api_key(running, adapters):
    r = httpx.post(f"{running.url}/v1/load_lora_adapter", json={"lora_name": "k", "lora_path": adapters["x"]},
                   timeout=30)
    assert r.status_code == 401
    assert "k" not in {c["id"] for c in httpx.get(f"{running.url}/v1/models", headers=AUTH).json()["data"]}


def test_routes_absent_without_runtime_updates(running):
    from ecoserve.server.app import create_app

    app = create_app(running.engine, "tiny", enable_lora=True)  # not started: only its routes are asked

    async def ask() -> int:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t") as c:
            return (await c.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "/x"})).status_code

    import asyncio
    assert asyncio.run(ask()) == 404


def test_requests_for_an_adapter_go_to_the_instance_that_holds_it(running, adapters):
    client = _client(running)
    for name in ("x", "y"):
        assert _load(running, name, adapters[name]).status_code == 200
    client.completions.create(model="x", prompt="first", max_tokens=2, temperature=0)  # loads x where it lands
    wait_until(lambda: any("x" in i["loras"] for i in _instances(running)), 10, "an instance to report x")
    holder = next(i["id"] for i in _instances(running) if "x" in i["loras"])
    before = {i["id"]: i["num_dispatched"] for i in _instances(running)}
    for k in range(6):  # round robin alone would alternate
        client.completions.create(model="x", prompt=f"again {k}", max_tokens=2, temperature=0)
    after = {i["id"]: i["num_dispatched"] for i in _instances(running)}
    assert after[holder] - before[holder] == 6 and sum(after.values()) - sum(before.values()) == 6
    client.completions.create(model="y", prompt="other", max_tokens=2, temperature=0)
    wait_until(lambda: any("y" in i["loras"] for i in _instances(running)), 10, "an instance to report y")
    for name in ("x", "y"):
        httpx.post(f"{running.url}/v1/unload_lora_adapter", json={"lora_name": name}, headers=AUTH, timeout=30)
