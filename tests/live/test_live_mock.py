"""EcoServe over mock instances (the real protocol and scheduler, no model): windows roll across 8 instances,
and mitosis applies to real instances by hand through POST /cluster/scale."""
from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from tests.live.conftest import mock_args, start_strategy, wait_until, write_profile

PROFILE = [(1, 8.0), (16, 12.0), (64, 25.0), (256, 60.0), (512, 110.0)]
PROMPT = "The quick brown fox jumps over the lazy dog. " * 2


@pytest.fixture(scope="module")
def profile(tmp_path_factory):
    return write_profile(tmp_path_factory.mktemp("mock") / "profile.csv", PROFILE)


async def _load(url: str, rate: float, duration: float, max_tokens: int) -> list[int]:
    """Requests at a steady rate; the status code of each."""
    async with httpx.AsyncClient(timeout=60) as client:
        async def one() -> int:
            r = await client.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": PROMPT,
                                                                 "max_tokens": max_tokens, "temperature": 0})
            return r.status_code
        tasks = []
        t0 = time.monotonic()
        k = 0
        while time.monotonic() - t0 < duration:
            tasks.append(asyncio.create_task(one()))
            k += 1
            await asyncio.sleep(max(t0 + k / rate - time.monotonic(), 0))
        return list(await asyncio.gather(*tasks))


@pytest.mark.slow
def test_windows_roll_across_eight_instances(tiny_model, profile):
    running = start_strategy(tiny_model, "ecoserve", 8, mock_args(tiny_model, profile), ttft_slo=0.5, tpot_slo=0.1)
    try:
        codes = asyncio.run(_load(running.url, rate=8.0, duration=20.0, max_tokens=24))
        assert codes and all(c == 200 for c in codes)
        windows = [i["num_windows"] for i in running.cluster()]
        total = sum(windows)
        assert total >= 16, windows
        for w in windows:  # each instance's share of windows within [0.5, 2] x 1/8
            assert 0.5 / 8 <= w / total <= 2 / 8, windows
    finally:
        running.stop()


def test_mitosis_by_hand(tiny_model, profile):
    running = start_strategy(tiny_model, "ecoserve", 2, mock_args(tiny_model, profile), ttft_slo=0.5, tpot_slo=0.1,
                             num_free_instances=1, mitosis={"n_lower": 1, "n_upper": 2})
    url = running.url
    try:
        states = [(i["state"], i["role"]) for i in running.cluster()]
        assert states == [("ready", 0), ("ready", 0), ("free", None)]
        r = httpx.post(f"{url}/cluster/scale", json={"macro": 0, "delta": 1})
        assert r.status_code == 200, r.text
        assert r.json()["actions"][0]["kind"] == "split"  # macro 0 is at N_u: the free instance starts macro 1
        assert [(i["state"], i["role"]) for i in running.cluster()][2] == ("ready", 1)
        assert httpx.post(f"{url}/cluster/scale", json={"macro": 0, "delta": 1}).status_code == 400  # no free left
        assert httpx.post(f"{url}/cluster/scale", json={"macro": 7, "delta": 1}).status_code == 400
        assert httpx.post(f"{url}/cluster/scale", json={"macro": 0, "delta": 2}).status_code == 400
        r = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": PROMPT, "max_tokens": 4}, timeout=30)
        assert r.status_code == 200
        r = httpx.post(f"{url}/cluster/scale", json={"macro": 0, "delta": -1})
        assert r.json()["actions"][0]["kind"] == "drain"
        drained = r.json()["actions"][0]["instances"][0]
        # drained, then released once it holds no request: back in the free pool
        wait_until(lambda: running.cluster()[drained]["state"] == "free", 10, "the drained instance to be released")
        r = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": PROMPT, "max_tokens": 4}, timeout=30)
        assert r.status_code == 200
    finally:
        running.stop()


def test_paper_strict_routes_live(tiny_model, profile):
    """Algorithm 1 as printed, over real connections: every request served, windows move with no timer."""
    running = start_strategy(tiny_model, "ecoserve", 4, mock_args(tiny_model, profile), ttft_slo=0.5, tpot_slo=0.1,
                             router_mode="paper-strict")
    try:
        codes = asyncio.run(_load(running.url, rate=8.0, duration=10.0, max_tokens=24))
        assert codes and all(c == 200 for c in codes)
        assert sum(i["num_windows"] for i in running.cluster()) >= 2
    finally:
        running.stop()
