"""Stream migration over real instance processes (a tiny random model, loopback): a SIGKILL mid-stream moves
the request to a survivor as prompt + output so far, and the client's stream goes on with neither a gap nor
a duplicate, equal to the fault-free stream for greedy and seeded sampling; past --max-migrations the
stream ends with an OpenAI-shaped error event; a request that streamed nothing is re-routed as before.

The tests share one cluster of five instances and each one loses some, in order (no restarts here)."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import httpx
import pytest

from ecoserve.live.shared import FrontendOptions
from ecoserve.sampling import SamplingParams
from tests.live.conftest import engine_args, model_facts, serve, wait_until

NUM_INSTANCES = 5
DEADLINE_S = 90.0
PROMPT = "The quick brown fox jumps over the lazy dog. A journey of"
MAX_TOKENS = 220  # a long stream: the kill lands well before its end even on a loaded machine
KILL_AT = 4  # tokens the client has when the serving instance is killed


def test_the_flag_sets_the_frontend_option(tiny_model):
    from ecoserve.cli import build_parser
    from ecoserve.live.serve import make_cluster_engine

    def option(*flags: str) -> int:
        args = build_parser().parse_args(["serve", "--strategy", "vllm", "--model", tiny_model, *flags])
        return make_cluster_engine(args).opts.max_migrations

    assert option() == 2 and option("--max-migrations", "0") == 0 and option("--max-migrations", "5") == 5


@pytest.fixture(scope="module")
def cluster(tiny_model):
    from ecoserve.live.serve import LiveCluster, build_cluster

    spec = LiveCluster("vllm", NUM_INSTANCES, instance_args=tuple(engine_args(tiny_model)))
    # restarts off: the survivors must carry the moved streams, and each kill leaves one instance fewer
    options = FrontendOptions(request_timeout_s=DEADLINE_S, max_migrations=1, max_restarts=0)
    running = serve(build_cluster(model_facts(tiny_model), spec, spec.options(2.0, 0.5, 512), options))
    yield running
    running.stop()


@pytest.fixture(scope="module")
def prompt_ids(cluster) -> list[int]:
    return cluster.engine.model.tokenizer.encode(PROMPT)


class Stream:
    """One request's stream as the frontend hands it out: each delta's token ids, text and logprobs."""

    def __init__(self) -> None:
        self.token_ids: list[list[int]] = []
        self.texts: list[str] = []
        self.logprobs: list = []
        self.last = None  # the last CompletionOutput
        self.error: BaseException | None = None
        self.killed_on: list[int] = []  # the instances killed under it

    @property
    def ids(self) -> list[int]:
        return [t for d in self.token_ids for t in d]

    @property
    def text(self) -> str:
        return "".join(self.texts)


def run_stream(cluster, rid: str, ids: list[int], params: SamplingParams, kill_at: tuple[int, ...] = ()) -> Stream:
    """Run one request on the frontend's loop; each time the stream reaches a count in `kill_at`, SIGKILL the
    instance serving it (a later kill waits until the request runs somewhere new)."""
    fe = cluster.engine
    s = Stream()

    async def run() -> None:
        kills = list(kill_at)
        try:
            async for out in fe.generate(rid, ids, params):
                c = out.outputs[0]
                s.token_ids.append(list(c.new_token_ids))
                s.texts.append(c.new_text)
                s.logprobs += list(c.new_logprobs or [])
                s.last = c
                req = fe.requests.get(rid)
                if kills and len(s.ids) >= kills[0] and req is not None and req.instance not in s.killed_on:
                    kills.pop(0)
                    s.killed_on.append(req.instance)
                    os.kill(fe.board[req.instance].pid, signal.SIGKILL)
        except Exception as e:  # what the client would see
            s.error = e

    asyncio.run_coroutine_threadsafe(run(), fe._loop).result(DEADLINE_S)
    return s


def live_instances(cluster) -> list[int]:
    return [i["id"] for i in cluster.cluster() if i["state"] != "lost"]


def assert_same_stream(got: Stream, want: Stream) -> None:
    assert got.error is None, got.error
    assert got.ids == want.ids  # no gap, no duplicate, and the same tokens
    assert got.text == want.text
    assert got.last.finish_reason == want.last.finish_reason == "length"


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
    SamplingParams(temperature=1.0, top_p=0.95, seed=1234, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)],
    ids=["greedy", "seeded"])
def test_a_stream_survives_a_kill_and_equals_the_fault_free_stream(cluster, prompt_ids, params):
    fe = cluster.engine
    name = "seeded" if params.seed is not None else "greedy"
    fault_free = run_stream(cluster, f"{name}-fault-free", prompt_ids, params)
    assert fault_free.error is None and len(fault_free.ids) == MAX_TOKENS
    before = dict(fe.counters)
    got = run_stream(cluster, f"{name}-killed", prompt_ids, params, kill_at=(KILL_AT,))
    assert len(got.killed_on) == 1
    assert_same_stream(got, fault_free)
    assert fe.counters["migrations"] == before["migrations"] + 1
    assert fe.counters["instance_deaths"] == before["instance_deaths"] + 1
    assert fe.counters["reroutes"] == before["reroutes"] and fe.counters["migration_failures"] == 0
    assert got.killed_on[0] not in live_instances(cluster)
    if params.logprobs is not None:  # the target's logprobs, computed from a prefill there: equal up to rounding
        assert len(got.logprobs) == MAX_TOKENS
        for a, b in zip(got.logprobs, fault_free.logprobs, strict=True):
            assert a.keys() == b.keys() and all(a[t] == pytest.approx(b[t], abs=1e-3) for t in a)
        assert got.last.cumulative_logprob == pytest.approx(fault_free.last.cumulative_logprob, abs=1e-2)


def test_a_request_that_streamed_nothing_is_rerouted(cluster, prompt_ids):
    """Every instance stopped, the request goes to one; the others go on: that one misses its heartbeats and the
    request, which has no token yet, is re-routed (not migrated) and completes."""
    fe = cluster.engine
    alive = live_instances(cluster)
    assert len(alive) >= 2
    pids = {i: fe.board[i].pid for i in alive}
    before = dict(fe.counters)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    reference = run_stream(cluster, "reroute-reference", prompt_ids, params)
    for pid in pids.values():
        os.kill(pid, signal.SIGSTOP)
    stopped = set(pids)
    try:
        box: list = []

        async def start():
            box.append(fe.generate("rerouted", prompt_ids, params))

        asyncio.run_coroutine_threadsafe(start(), fe._loop).result(10)
        wait_until(lambda: fe.requests.get("rerouted") is not None and fe.requests["rerouted"].instance is not None,
                   10, "the request to be dispatched")
        first = fe.requests["rerouted"].instance
        for i, pid in pids.items():
            if i != first:
                os.kill(pid, signal.SIGCONT)
                stopped.discard(i)

        async def drain():
            return [o async for o in box[0]]

        outs = asyncio.run_coroutine_threadsafe(drain(), fe._loop).result(DEADLINE_S)
    finally:
        for i in stopped:
            try:
                os.kill(pids[i], signal.SIGCONT)
            except ProcessLookupError:
                pass
    assert outs[-1].finished and outs[-1].outputs[0].token_ids == reference.ids
    assert fe.counters["reroutes"] == before["reroutes"] + 1
    assert fe.counters["migrations"] == before["migrations"]
    wait_until(lambda: first not in live_instances(cluster), 10, "the stopped instance to be lost")


def test_past_max_migrations_the_stream_ends_with_an_error_event(cluster, prompt_ids):
    """With --max-migrations 1: the first kill moves the stream, the second ends it with an OpenAI-shaped error
    event naming the cause, after the text so far (which is the fault-free stream's beginning)."""
    fe = cluster.engine
    assert len(live_instances(cluster)) == 2
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    fault_free = run_stream(cluster, "limit-reference", prompt_ids, params)
    before = dict(fe.counters)
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True,
            "ignore_eos": True}
    texts, errors, killed = [], [], []
    with httpx.stream("POST", f"{cluster.url}/v1/completions", json=body, timeout=DEADLINE_S) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: "):])
            if "error" in event:
                errors.append(event["error"])
                continue
            texts.append(event["choices"][0]["text"])
            running = [r for r in list(fe.requests.values()) if r.instance is not None]
            if len(texts) >= KILL_AT * (len(killed) + 1) and running and running[0].instance not in killed:
                killed.append(running[0].instance)
                os.kill(fe.board[running[0].instance].pid, signal.SIGKILL)
    assert len(killed) == 2
    assert len(errors) == 1 and "max-migrations" in errors[0]["message"], errors
    assert set(errors[0]) >= {"message", "type", "code"}
    text = "".join(texts)
    assert len(text) > 0 and fault_free.text.startswith(text)
    assert fe.counters["migrations"] == before["migrations"] + 1
    assert fe.counters["migration_failures"] == before["migration_failures"] + 1
    metrics = httpx.get(f"{cluster.url}/metrics", timeout=10).text
    assert "cluster_migrations_total" in metrics and "cluster_migration_failures_total" in metrics
    deadline = time.monotonic() + 10
    while fe.requests and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not fe.requests  # nothing left behind


# ---- FuDG: the KV of a stream on a lost decode instance is gone: re-prefill prompt + output, then transfer ----
@pytest.fixture(scope="module")
def fudg(tiny_model):
    from ecoserve.live.serve import LiveCluster, build_cluster

    spec = LiveCluster("distserve", 3, controller={"pd": (1, 2)}, instance_args=tuple(engine_args(tiny_model)))
    options = FrontendOptions(request_timeout_s=DEADLINE_S, max_restarts=0)
    running = serve(build_cluster(model_facts(tiny_model), spec, spec.options(2.0, 0.5, 512), options))
    yield running
    running.stop()


def single_engine(model: str, ids: list[int], params: SamplingParams):
    """The reference: one in-process engine."""
    from ecoserve.engine.llm import LLM
    from tests.live.conftest import MAX_MODEL_LEN

    llm = LLM(model, num_threads=1, max_model_len=MAX_MODEL_LEN, num_gpu_blocks=128, max_num_seqs=16,
              max_num_batched_tokens=512)
    return llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0].outputs[0]


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
SEEDED = SamplingParams(temperature=1.0, top_p=0.95, seed=77, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_fudg_equals_one_engine(fudg, tiny_model, prompt_ids, params):
    """The decode leg continues the prefill's draws: FuDG equals one engine, for seeded sampling too."""
    got = run_stream(fudg, f"fudg-{params.temperature}", prompt_ids, params)
    reference = single_engine(tiny_model, prompt_ids, params)
    assert got.error is None
    assert got.ids == list(reference.token_ids) and got.text == reference.text


def test_fudg_stream_survives_its_decode_instance(fudg, prompt_ids):
    """A seeded stream whose decode instance is killed is prefilled again (prompt + output: its KV is gone),
    its KV moves to the other decode instance, and it goes on exactly."""
    fe = fudg.engine
    fault_free = run_stream(fudg, "fudg-fault-free", prompt_ids, SEEDED)
    before = dict(fe.counters)
    got = run_stream(fudg, "fudg-killed", prompt_ids, SEEDED, kill_at=(KILL_AT,))
    assert got.killed_on and got.killed_on[0] != 0  # it was decoding (instance 0 prefills) when killed
    assert_same_stream(got, fault_free)
    assert fe.counters["migrations"] == before["migrations"] + 1
    assert fe.counters["kv_bytes_moved"] > before["kv_bytes_moved"]  # a second prefill's KV moved
    assert live_instances(fudg) == [0, 3 - got.killed_on[0]]
