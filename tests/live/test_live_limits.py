"""The cluster frontend under requests that once blocked its event loop: a 50 MB body and prompts far past the
context get their 413/400 at once, a running stream's inter-token gaps stay bounded, and no instance is lost."""
from __future__ import annotations

import asyncio

import httpx
import pytest

from tests.live.conftest import MAX_MODEL_LEN, mock_args, start_strategy, write_profile
from tests.utils import stream_gaps

PROFILE = [(1, 8.0), (16, 12.0), (64, 25.0), (256, 60.0), (512, 110.0)]


@pytest.fixture(scope="module")
def cluster(tiny_model, tmp_path_factory):
    profile = write_profile(tmp_path_factory.mktemp("limits") / "profile.csv", PROFILE)
    running = start_strategy(tiny_model, "vllm", 2, mock_args(tiny_model, profile))
    yield running
    running.stop()



def test_oversized_requests_do_not_stall_the_cluster(cluster):
    url = cluster.url
    max_chars = cluster.server.config.app.state.server.max_prompt_chars
    prompts = ["word " * (2 * MAX_MODEL_LEN), "z" * (max_chars + 1)]  # 10x max_model_len chars; past any context

    async def run() -> tuple[list[float], list[httpx.Response]]:
        started = asyncio.Event()
        stream = asyncio.create_task(stream_gaps(url, started))
        await asyncio.wait_for(started.wait(), 60)
        answers = []
        async with httpx.AsyncClient(timeout=60) as client:
            for _ in range(100):  # bounded: until the stream ends
                answers.append(await client.post(f"{url}/tokenize", content=b"x" * (50 * 2**20),
                                                 headers={"content-type": "application/json"}))
                for text in prompts:
                    answers.append(await client.post(f"{url}/v1/completions", json={"prompt": text, "max_tokens": 2}))
                if stream.done():
                    break
        return await stream, answers

    gaps, answers = asyncio.run(run())
    assert len(answers) >= 3
    for r in answers:
        assert r.status_code in (400, 413), r.text
        assert r.json()["error"]["code"] in ("context_length_exceeded", "request_too_large")
    assert len(gaps) >= 20 and max(gaps) < 2.0, max(gaps)
    assert [i["state"] for i in cluster.cluster()] == ["ready", "ready"]
    assert httpx.get(f"{url}/cluster").json()["counters"]["instance_deaths"] == 0
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "after", "max_tokens": 4}, timeout=60)
    assert r.status_code == 200, r.text
