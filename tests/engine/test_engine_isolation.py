"""One request can never end the engine: what one request raises in a step fails that request alone (its
stream gets the error, an OpenAI stream an error event) and every other request, and the engine, go on."""
from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from ecoserve.engine.llm_engine import LLMEngine, RequestFailedError, sample_seed
from ecoserve.sampling import SEED_MAX, SEED_MIN, SamplingParams
from tests.server.conftest import ENGINE_KWARGS, start_server, wait_idle
from tests.utils import make_tiny_checkpoint

POISON = "poison"  # prompts holding it raise in their own step processing (a fault injected for the test)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    return str(make_tiny_checkpoint(tmp_path_factory.mktemp("isolation_model") / "tiny", "llama"))


def poison_outputs(engine: LLMEngine) -> None:
    """Make building the output of any request whose prompt holds POISON raise, as a per-request bug would."""
    build = engine._make_output

    def make_output(parent):
        if parent.prompt and POISON in parent.prompt:
            raise RuntimeError("injected fault in this request's output")
        return build(parent)

    engine._make_output = make_output


@pytest.fixture(scope="module")
def engine(tiny_model) -> LLMEngine:
    from ecoserve.config import EngineArgs

    llm = LLMEngine(EngineArgs(tiny_model, **ENGINE_KWARGS).create_engine_config())
    poison_outputs(llm)
    return llm


def run_to_end(engine: LLMEngine, max_steps: int = 500) -> tuple[dict, dict]:
    """Step until idle (bounded); the final output of each request and the failures."""
    finals, failed = {}, {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
        failed.update(engine.take_failed())
    assert not engine.has_unfinished_requests(), "the engine did not finish within the step bound"
    return finals, failed


def test_a_request_that_raises_in_a_step_fails_alone(engine):
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    engine.add_request("good-1", "hello there", greedy)
    engine.add_request("bad", f"{POISON} here", greedy)
    engine.add_request("good-2", "another one", greedy.clone(n=2, temperature=1.0, seed=3))
    finals, failed = run_to_end(engine)
    assert set(failed) == {"bad"} and isinstance(failed["bad"], RequestFailedError)
    assert "injected fault" in str(failed["bad"]) and "'bad'" in str(failed["bad"])
    assert set(finals) == {"good-1", "good-2"}
    assert all(len(c.token_ids) == 8 for out in finals.values() for c in out.outputs)
    assert engine.scheduler.kv.usage == 0  # the failed request's blocks are free too
    engine.add_request("after", "hello there", greedy)  # the engine goes on, the id space too
    engine.add_request("bad", "hello again", greedy)  # the failed id is free again
    finals, failed = run_to_end(engine)
    assert set(finals) == {"after", "bad"} and not failed


def test_a_seed_past_int64_is_refused_at_add_even_when_set_after_construction(engine):
    params = SamplingParams(temperature=1.0, seed=1, max_tokens=4)
    params.seed = 2**64  # past SamplingParams' own check: the engine checks again
    with pytest.raises(ValueError, match="seed"):
        engine.add_request("huge-seed", "hello", params)
    engine.add_request("fine", "hello", SamplingParams(temperature=1.0, seed=SEED_MAX, max_tokens=4, n=3))
    finals, failed = run_to_end(engine)
    assert set(finals) == {"fine"} and not failed


def test_sample_seeds_stay_in_int64():
    assert sample_seed(5, 2) == 7
    assert sample_seed(SEED_MAX, 1) == SEED_MIN
    assert all(SEED_MIN <= sample_seed(SEED_MAX - 1, i) <= SEED_MAX for i in range(4))
    with pytest.raises(ValueError, match=r"seed must be None or an integer in \["):
        SamplingParams(seed=2**63)


def test_offline_llm_reports_the_failed_request_and_goes_on(tiny_model):
    from ecoserve.engine.llm import LLM

    llm = LLM(tiny_model, **ENGINE_KWARGS)
    poison_outputs(llm.llm_engine)
    greedy = SamplingParams(temperature=0, max_tokens=4)
    with pytest.raises(RequestFailedError, match="injected fault"):
        llm.generate(["fine", f"{POISON} prompt"], greedy, use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    out = llm.generate(["fine"], greedy, use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


@pytest.fixture(scope="module")
def server(tiny_model):
    running = start_server(tiny_model)
    poison_outputs(running.llm_engine)
    yield running
    running.stop()


def test_seed_2_64_straight_to_the_engine_fails_only_that_request(server):
    params = SamplingParams(temperature=1.0, seed=1, max_tokens=4)
    params.seed = 2**64

    async def straight() -> None:
        stream = server.engine.generate("straight", [5, 6, 7], params)
        async for _ in stream:
            pass

    fut = asyncio.run_coroutine_threadsafe(straight(), server.engine._loop)
    with pytest.raises(ValueError, match="seed"):
        fut.result(timeout=30)
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi", "max_tokens": 4, "seed": 1,
                                                         "temperature": 1.0}, timeout=60)
    assert r.status_code == 200, r.text
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_a_failing_stream_gets_an_error_event_and_the_others_finish(server):
    async def one(client: httpx.AsyncClient, prompt: str) -> list[dict]:
        events = []
        body = {"prompt": prompt, "max_tokens": 30, "temperature": 0, "ignore_eos": True, "stream": True}
        async with client.stream("POST", f"{server.url}/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
        return events

    async def run() -> list[list[str]]:
        async with httpx.AsyncClient(timeout=60) as client:
            return await asyncio.gather(one(client, "a good one"), one(client, f"{POISON} one"),
                                        one(client, "another good one"))

    good, bad, good2 = asyncio.run(run())
    for events in (good, good2):
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert "error" not in chunks[-1] and chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert bad[-1] == "[DONE]"
    error = json.loads(bad[-2])["error"]
    assert "failed in the engine" in error["message"] and "injected fault" in error["message"]
    assert error["type"] == "server_error"
    # non-streamed: a 500 naming the failure; the engine still serves
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": f"{POISON} again", "max_tokens": 4}, timeout=60)
    assert r.status_code == 500 and "failed in the engine" in r.json()["error"]["message"]
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "fine", "max_tokens": 4}, timeout=60)
    assert r.status_code == 200
    assert httpx.get(f"{server.url}/health").status_code == 200 and server.engine.is_running
    wait_idle(server)
