"""LoRA adapters on one engine through HTTP: `--lora-modules` at start-up, runtime load/unload driven by the
official `openai` client, adapters chosen by `model`, /v1/models, bad adapters, the API key, the metrics,
and the routes absent without runtime updates."""
from __future__ import annotations

import argparse
from pathlib import Path

import httpx
import openai
import pytest

from ecoserve.bench.adapters import random_lora_adapter
from ecoserve.server.lora import LoRAModulePath, parse_lora_module, runtime_updates_allowed
from tests.server.conftest import start_server

KEY = "sk-lora"
AUTH = {"Authorization": f"Bearer {KEY}"}


def make_adapter(base: str, path: Path, rank: int = 8, seed: int = 0) -> str:
    return str(random_lora_adapter(base, path, rank, seed))


@pytest.fixture(scope="module")
def adapters(tiny_model, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("adapters")
    return {"a": make_adapter(tiny_model, root / "a", seed=1), "b": make_adapter(tiny_model, root / "b", seed=2),
            "wide": make_adapter(tiny_model, root / "wide", rank=64, seed=3)}


@pytest.fixture(scope="module")
def server(tiny_model, adapters):
    running = start_server(tiny_model, enable_lora=True, max_loras=2, max_lora_rank=16,
                           app_kwargs={"api_key": KEY, "enable_lora": True, "allow_runtime_lora_updating": True,
                                       "lora_modules": [LoRAModulePath("a", adapters["a"], "tiny")]})
    yield running
    running.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=60)


def _greedy(client: openai.OpenAI, model: str, prompt: str = "the quick brown fox") -> list[str]:
    out = client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0, logprobs=0)
    assert out.model == model
    return out.choices[0].logprobs.tokens


def _load(client: openai.OpenAI, name: str, path: str) -> httpx.Response:
    return client.post("/load_lora_adapter", body={"lora_name": name, "lora_path": path}, cast_to=httpx.Response)


def test_lora_modules_parse_both_forms():
    assert parse_lora_module("sql=/a/b") == LoRAModulePath("sql", "/a/b")
    assert parse_lora_module('{"name": "c", "path": "/p", "base_model_name": "m"}') == LoRAModulePath("c", "/p", "m")
    for bad in ("sql", "=/p", '{"name": "c"}', '{"name": "c", "path": "/p", "rank": 8}', "{bad json"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_lora_module(bad)


def test_runtime_updates_follow_the_flag_or_vllms_variable(monkeypatch):
    monkeypatch.delenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
    assert not runtime_updates_allowed(False) and runtime_updates_allowed(True)
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")
    assert runtime_updates_allowed(False)


def test_models_list_the_adapters_with_their_parent(client, adapters):
    cards = {m.id: m.model_extra for m in client.models.list().data}
    assert cards["a"]["parent"] == "tiny" and cards["a"]["root"] == adapters["a"]
    assert cards["tiny"].get("parent") is None
    assert client.models.retrieve("a").id == "a"


def test_an_adapter_changes_the_output_and_the_base_model_does_not_change(client):
    base = _greedy(client, "tiny")
    with_a = _greedy(client, "a")
    assert with_a != base  # random A and B on q and v
    assert _greedy(client, "tiny") == base and _greedy(client, "a") == with_a
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="missing", prompt="hi", max_tokens=2)
    assert e.value.body["code"] == "model_not_found"


def test_load_serve_and_unload_at_runtime(client, adapters):
    r = _load(client, "b", adapters["b"])
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'b' added successfully."
    with_b = _greedy(client, "b")
    assert with_b != _greedy(client, "a")
    with pytest.raises(openai.BadRequestError):  # already loaded
        _load(client, "b", adapters["b"])
    r = client.post("/unload_lora_adapter", body={"lora_name": "b"}, cast_to=httpx.Response)
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'b' removed successfully."
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="b", prompt="hi", max_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client.post("/unload_lora_adapter", body={"lora_name": "b"}, cast_to=httpx.Response)
    assert _load(client, "b", adapters["b"]).status_code == 200  # again, under a new id
    assert _greedy(client, "b") == with_b


def test_bad_adapters_are_a_400_and_serving_goes_on(client, adapters, tmp_path):
    base = _greedy(client, "tiny")
    with pytest.raises(openai.BadRequestError) as e:
        _load(client, "wide", adapters["wide"])  # rank 64 > --max-lora-rank 16
    assert "wide" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError):
        _load(client, "nowhere", str(tmp_path / "nowhere"))
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "adapter_config.json").write_text("{not json")
    with pytest.raises(openai.BadRequestError):
        _load(client, "broken", str(tmp_path / "broken"))
    assert {"wide", "nowhere", "broken"}.isdisjoint(m.id for m in client.models.list().data)
    assert _greedy(client, "tiny") == base


def test_the_routes_need_the_api_key(server, adapters):
    r = httpx.post(f"{server.url}/v1/load_lora_adapter", json={"lora_name": "k", "lora_path": adapters["b"]})
    assert r.status_code == 401
    r = httpx.post(f"{server.url}/v1/unload_lora_adapter", json={"lora_name": "a"})
    assert r.status_code == 401


def test_metrics_show_the_adapters(client, server):
    _greedy(client, "a")
    text = httpx.get(f"{server.url}/metrics", headers=AUTH).text
    info = [line for line in text.splitlines() if line.startswith("ecoserve:lora_requests_info{")]
    assert len(info) == 1 and 'max_lora="2"' in info[0] and 'running_lora_adapters=""' in info[0]
    assert float(info[0].rsplit(" ", 1)[1]) > 1.6e9  # a Unix time, as vLLM's
    loads = next(line for line in text.splitlines() if line.startswith("ecoserve:lora_adapter_loads_total{"))
    assert float(loads.rsplit(" ", 1)[1]) >= 1
    assert "ecoserve:lora_slot_evictions_total{" in text


def test_without_runtime_updates_the_routes_are_absent(server):
    from ecoserve.server.app import create_app

    app = create_app(server.engine, "tiny", enable_lora=True)  # not started: only its routes are asked

    async def ask() -> list[int]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t") as c:
            return [(await c.post(p, json={"lora_name": "a", "lora_path": "/x"})).status_code
                    for p in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")]

    import asyncio
    assert asyncio.run(ask()) == [404, 404]
    with pytest.raises(ValueError, match="--enable-lora"):
        create_app(server.engine, "tiny", lora_modules=[LoRAModulePath("a", "/x")])


def test_serve_flags():
    from ecoserve.cli import build_parser

    args = build_parser().parse_args(["serve", "--enable-lora", "--max-loras", "4", "--lora-modules", "sql=/a",
                                      '{"name": "chat", "path": "/b", "base_model_name": "m"}',
                                      "--allow-runtime-lora-updating"])
    assert args.enable_lora and args.max_loras == 4 and args.allow_runtime_lora_updating
    assert args.lora_modules == [LoRAModulePath("sql", "/a"), LoRAModulePath("chat", "/b", "m")]
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--lora-modules", "no-path"])
