"""LoRA over a live cluster with a real instance: the instance loads an adapter when the first request for it
arrives, its greedy output equals one in-process engine's with the same adapter, `/cluster` lists it, and an
adapter the instance's engine refuses is a 400 while the instance goes on serving."""
from __future__ import annotations

import httpx
import pytest

from ecoserve.bench.adapters import random_lora_adapter
from tests.live.conftest import MAX_MODEL_LEN, instance_args, start_strategy, wait_until

PROMPT = "the quick brown fox"


@pytest.fixture(scope="module")
def adapters(tiny_model, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("live_adapters")
    return {"a": str(random_lora_adapter(tiny_model, root / "a", rank=8, seed=11)),
            "wide": str(random_lora_adapter(tiny_model, root / "wide", rank=64, seed=12))}


@pytest.fixture(scope="module")
def running(tiny_model):
    cluster = start_strategy(tiny_model, "vllm", 1,
                             instance_args(tiny_model, "prefill_first", "--enable-lora", "--max-lora-rank", "16"),
                             app_kwargs={"enable_lora": True, "allow_runtime_lora_updating": True})
    yield cluster
    cluster.stop()


def _complete(url: str, model: str) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json={"model": model, "prompt": PROMPT, "max_tokens": 8,
                                                     "temperature": 0}, timeout=120)


def test_an_adapter_loads_on_demand_and_matches_one_engine(running, tiny_model, adapters):
    from ecoserve import LLM, LoRARequest, SamplingParams

    url = running.url
    r = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": adapters["a"]}, timeout=30)
    assert r.status_code == 200
    assert running.cluster()[0]["loras"] == []  # registered at the frontend; the instance loads it on demand
    out = _complete(url, "a")
    assert out.status_code == 200, out.text
    wait_until(lambda: running.cluster()[0]["loras"] == ["a"], 10, "the instance to report adapter a")
    llm = LLM(tiny_model, num_threads=1, max_model_len=MAX_MODEL_LEN, num_gpu_blocks=128, max_num_seqs=16,
              max_num_batched_tokens=512, enable_lora=True, max_lora_rank=16)
    params = SamplingParams(temperature=0.0, max_tokens=8)
    ref = llm.generate([PROMPT], params, use_tqdm=False, lora_request=LoRARequest("a", 1, adapters["a"]))
    base = llm.generate([PROMPT], params, use_tqdm=False)
    assert out.json()["choices"][0]["text"] == ref[0].outputs[0].text
    assert ref[0].outputs[0].token_ids != base[0].outputs[0].token_ids  # the adapter matters


def test_an_adapter_the_instance_refuses_is_a_400(running, adapters):
    url = running.url
    r = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "wide", "lora_path": adapters["wide"]},
                   timeout=30)
    assert r.status_code == 200  # the frontend only checks that the checkpoint is there
    out = _complete(url, "wide")  # rank 64 > the instances' --max-lora-rank 16
    assert out.status_code == 400 and "max-lora-rank" in out.json()["error"]["message"]
    assert _complete(url, "tiny").status_code == 200
    assert running.cluster()[0]["state"] == "ready"
