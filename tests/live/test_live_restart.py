"""Lost instances replaced, with real processes: a killed instance restarts in its slot and rejoins routing; the
restart limit leaves a slot lost and it leaves the board after the grace period; a blocked frontend loses nobody;
a stream that never starts is aborted; a failed request leaves the metrics; a 1:1 distserve cluster that loses
its prefill instance keeps serving and disaggregates again once the replacement is ready."""
from __future__ import annotations

import asyncio
import gc
import os
import signal
import time

import httpx
import openai
import pytest

from ecoserve.live.errors import InstanceLostError
from ecoserve.live.shared import FrontendOptions
from ecoserve.sampling import SamplingParams
from tests.live.conftest import mock_args, model_facts, serve, start_cluster, wait_until, write_profile
from tests.live.fakes import FakeNoDG

PROFILE = [(1, 20.0), (4, 25.0), (8, 60.0), (512, 200.0)]
PROMPT = "The quick brown fox jumps over the lazy dog."
DEADLINE_S = 60.0
MAX_RESTARTS = 2
GRACE_S = 4.0
JOIN_S = 120.0  # a restarted instance imports torch and loads its engine: generous on a loaded machine


class RejoiningNoDG(FakeNoDG):
    """The test NoDG controller, routing to an instance again once it rejoins."""

    def handle(self, e):
        if type(e).__name__ == "InstanceJoined" and e.instance_id not in self.router.instances:
            self.events.append(e)
            self.router.instances.append(e.instance_id)
            return []
        return super().handle(e)


@pytest.fixture(scope="module")
def profile(tmp_path_factory):
    return write_profile(tmp_path_factory.mktemp("restart") / "profile.csv", PROFILE)


@pytest.fixture(scope="module")
def cluster(tiny_model, profile):
    options = FrontendOptions(request_timeout_s=DEADLINE_S, restart_backoff_s=0.5, max_restarts=MAX_RESTARTS,
                              lost_grace_s=GRACE_S)
    running = start_cluster(tiny_model, lambda step_time, status_of: RejoiningNoDG([0, 1], status_of), 2,
                            lambda iid: mock_args(tiny_model, profile), options=options)
    yield running
    running.stop()


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", timeout=DEADLINE_S, max_retries=0)


def entry(cluster, iid: int) -> dict | None:
    return next((i for i in cluster.cluster() if i["id"] == iid), None)


def complete(cluster, max_tokens: int = 4) -> None:
    out = client(cluster.url).completions.create(model="tiny", prompt=PROMPT, max_tokens=max_tokens, temperature=0)
    assert out.usage.completion_tokens == max_tokens


def on_loop(cluster, coro_fn):
    fe = cluster.engine
    return asyncio.run_coroutine_threadsafe(coro_fn(), fe._loop).result(DEADLINE_S)


def test_killed_instance_restarts_in_its_slot_and_is_routed_again(cluster):
    fe = cluster.engine
    old_pid = entry(cluster, 0)["pid"]
    os.kill(old_pid, signal.SIGKILL)
    wait_until(lambda: (entry(cluster, 0) or {}).get("restarts") == 1, 30, "the restart to start")
    wait_until(lambda: entry(cluster, 0)["state"] == "ready", JOIN_S, "the restarted instance to join")
    e = entry(cluster, 0)
    assert e["pid"] != old_pid and e["lost_reason"] is None
    assert fe.counters["restarts"] == 1 and fe.counters["instance_deaths"] == 1
    body = httpx.get(f"{cluster.url}/metrics", timeout=10).text
    assert any(line.startswith("ecoserve:cluster_restarts") and line.rstrip().endswith(" 1.0")
               for line in body.splitlines()), body
    joins = [ev for ev in fe.controller.events if type(ev).__name__ == "InstanceJoined" and ev.instance_id == 0]
    assert joins, "the controller never heard that instance 0 is back"
    sent = fe.controller.sent[0]
    for _ in range(4):  # round robin over both again
        complete(cluster)
    assert fe.controller.sent[0] >= sent + 2


def test_restart_limit_leaves_the_slot_lost_then_off_the_board(cluster):
    fe = cluster.engine
    for n in range(2, MAX_RESTARTS + 1):  # use up the restarts
        os.kill(entry(cluster, 0)["pid"], signal.SIGKILL)
        wait_until(lambda: (entry(cluster, 0) or {}).get("restarts") == n, 30, f"restart {n}")
        wait_until(lambda: entry(cluster, 0)["state"] == "ready", JOIN_S, f"restart {n} to join")
    os.kill(entry(cluster, 0)["pid"], signal.SIGKILL)
    wait_until(lambda: entry(cluster, 0)["state"] == "lost", 20, "the loss past the limit")
    t_lost = time.monotonic()
    assert "not restarted" in entry(cluster, 0)["lost_reason"]
    complete(cluster)  # the other instance serves
    wait_until(lambda: entry(cluster, 0) is None, GRACE_S + 20, "the lost slot to leave the board")
    assert time.monotonic() - t_lost >= GRACE_S - 1.0
    assert fe.counters["restarts"] == MAX_RESTARTS
    assert [i["id"] for i in cluster.cluster()] == [1]


def test_a_blocked_frontend_loop_loses_no_instance(cluster):
    """3.5 s without the loop (more than the 2-s heartbeat allowance): the instances were not silent, it was deaf."""
    fe = cluster.engine
    deaths = fe.counters["instance_deaths"]
    stream = client(cluster.url).completions.create(model="tiny", prompt=PROMPT, max_tokens=60, temperature=0,
                                                    stream=True)
    chunks = iter(stream)
    next(chunks)
    fe._loop.call_soon_threadsafe(time.sleep, 3.5)
    text = [c for c in chunks]
    assert text and text[-1].choices[0].finish_reason == "length"
    time.sleep(1.0)  # a watch tick or more after the block
    assert fe.counters["instance_deaths"] == deaths
    assert all(i["state"] == "ready" for i in cluster.cluster())
    assert fe.health.time_given_back >= 3.0


def test_a_stream_that_never_starts_is_aborted(cluster):
    fe = cluster.engine

    async def start_and_drop():
        fe.generate("never-read", [5, 6, 7, 8, 9, 10], SamplingParams(max_tokens=200, temperature=0))
        gc.collect()

    aborts = [e for e in fe.controller.events if type(e).__name__ == "RequestAborted"]
    on_loop(cluster, start_and_drop)
    wait_until(lambda: "never-read" not in fe.requests, 10, "the dropped stream's request to be aborted")
    events = [e for e in fe.controller.events if type(e).__name__ == "RequestAborted"]
    assert len(events) == len(aborts) + 1 and events[-1].request_id == "never-read"


def test_a_request_that_fails_after_streaming_leaves_the_metrics(cluster):
    fe = cluster.engine
    metrics = fe.observer

    async def stream_then_fail():
        stream = fe.generate("fails", [5, 6, 7, 8, 9, 10], SamplingParams(max_tokens=200, temperature=0))
        got = [await stream.__anext__() for _ in range(3)]
        assert "fails" in metrics._seen  # the observer tracks it while it streams
        fe.fail(fe.requests["fails"], InstanceLostError("the instance went away"))
        with pytest.raises(InstanceLostError):
            while True:
                await stream.__anext__()
        return got

    before = metrics.success.labels("tiny", "abort")._value.get()
    on_loop(cluster, stream_then_fail)
    assert "fails" not in metrics._seen
    assert metrics.success.labels("tiny", "abort")._value.get() == before + 1


# ---- FuDG: the survivor serves both roles -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def distserve(tiny_model, profile):
    from ecoserve.live.serve import LiveCluster, build_cluster

    spec = LiveCluster("distserve", 2, 0, {"pd": (1, 1)}, tuple(mock_args(tiny_model, profile)))
    running = serve(build_cluster(model_facts(tiny_model), spec, spec.options(2.0, 0.5, 512),
                                  FrontendOptions(request_timeout_s=DEADLINE_S, restart_backoff_s=5.0)))
    yield running
    running.stop()


def test_distserve_1to1_keeps_serving_without_its_prefill_instance(distserve):
    """Disaggregated, a request is dispatched twice (prefill instance 0, then decode instance 1); whole, once."""
    fe = distserve.engine
    sent = fe.controller.num_dispatched

    def served(dispatched_to: tuple[int, int]) -> None:
        before = dict(sent)
        complete(distserve, 6)
        assert (sent[0] - before[0], sent[1] - before[1]) == dispatched_to

    served((1, 1))
    os.kill(entry(distserve, 0)["pid"], signal.SIGKILL)
    wait_until(lambda: entry(distserve, 0)["state"] in ("lost", "starting"), 20, "the prefill instance's loss")
    assert not fe.controller.disaggregated
    for _ in range(3):  # whole requests on the decode instance
        served((0, 1))
    wait_until(lambda: entry(distserve, 0)["state"] == "ready", JOIN_S, "the new prefill instance to join")
    assert fe.controller.disaggregated and fe.counters["restarts"] == 1
    served((1, 1))  # disaggregated again


def test_restart_backoff_doubles_and_is_capped():
    from ecoserve.live.supervisor import restart_backoff

    assert [restart_backoff(1.0, n) for n in range(7)] == [1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0]
    assert restart_backoff(45.0, 3) == 45.0  # a base above the cap is the cap


def test_an_instance_that_never_joins_is_restarted_up_to_the_limit(tiny_model, tmp_path):
    """Every start fails (no such profile file): restarted twice, then the slot stays lost and the cluster,
    with no instance ever joined, reports itself dead instead of waiting."""
    from ecoserve.live.frontend import ClusterEngine
    from ecoserve.live.launchers import LocalLauncher

    launcher = LocalLauncher(lambda iid: mock_args(tiny_model, str(tmp_path / "missing.csv")),
                             env={"OMP_NUM_THREADS": "1"})
    fe = ClusterEngine(model_facts(tiny_model), lambda step_time, status_of: FakeNoDG([0], status_of), [0], launcher,
                       FrontendOptions(restart_backoff_s=0.2, max_restarts=2))

    async def run():
        fe.start()
        try:
            await asyncio.wait_for(fe.ready.wait(), 180)
        finally:
            await fe.stop()

    asyncio.run(run())
    h = fe.board[0]
    assert fe.dead_error is not None and "no instance joined" in str(fe.dead_error)
    assert h.state == "lost" and h.restarts == 2 and fe.counters["restarts"] == 2
    assert "exited with code" in h.lost_reason and "not restarted" in h.lost_reason


def test_ray_instance_is_replaced_by_a_new_actor_in_its_slot(tiny_model, profile):
    pytest.importorskip("ray")
    from tests.live.conftest import start_strategy

    running = start_strategy(tiny_model, "vllm", 2, mock_args(tiny_model, profile), launcher="ray")
    try:
        launcher = running.engine.launcher
        old_actor, old_pid = launcher.actors[0], entry(running, 0)["pid"]
        os.kill(old_pid, signal.SIGKILL)
        wait_until(lambda: entry(running, 0)["restarts"] == 1, 60, "the Ray instance's restart")
        wait_until(lambda: entry(running, 0)["state"] == "ready", JOIN_S, "the new actor to join")
        assert launcher.actors[0] is not old_actor and entry(running, 0)["pid"] != old_pid
        for _ in range(2):
            complete(running)
        assert running.engine.controller.num_dispatched[0] >= 1
    finally:
        running.stop()


def test_restart_flags_reach_the_frontend(tiny_model):
    from ecoserve.cli import build_parser
    from ecoserve.live.serve import make_cluster_engine

    base = ["serve", "--strategy", "vllm", "--model", tiny_model, "--max-model-len", "256"]
    fe = make_cluster_engine(build_parser().parse_args(
        [*base, "--max-instance-restarts", "3", "--instance-restart-backoff", "0.25"]))
    assert (fe.opts.max_restarts, fe.opts.restart_backoff_s) == (3, 0.25)
    default = make_cluster_engine(build_parser().parse_args(base))
    assert (default.opts.max_restarts, default.opts.restart_backoff_s) == (5, 1.0)
    with pytest.raises(ValueError, match="--max-instance-restarts must be >= 0"):
        make_cluster_engine(build_parser().parse_args([*base, "--max-instance-restarts", "-1"]))
    with pytest.raises(ValueError, match="--instance-restart-backoff must be > 0"):
        make_cluster_engine(build_parser().parse_args([*base, "--instance-restart-backoff", "0"]))


def test_a_lost_hand_started_instance_is_not_restarted_and_leaves_the_board(tiny_model, profile):
    import socket
    import subprocess

    from ecoserve.live.frontend import ClusterEngine
    from ecoserve.live.launchers import instance_command

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    address = f"tcp://127.0.0.1:{port}"
    fe = ClusterEngine(model_facts(tiny_model), lambda step_time, status_of: RejoiningNoDG([0], status_of), [0],
                       None, FrontendOptions(bind=address, request_timeout_s=DEADLINE_S, lost_grace_s=2.0))

    def by_hand():
        return subprocess.Popen(instance_command(address, [*mock_args(tiny_model, profile), "--cluster-auth", "none"]),
                                env={**os.environ, "OMP_NUM_THREADS": "1"})

    procs = [by_hand()]
    running = serve(fe)
    try:
        assert [i["id"] for i in running.cluster()] == [0]
        procs[0].kill()
        wait_until(lambda: (entry(running, 0) or {}).get("state") == "lost", 20, "the hand-started instance's loss")
        wait_until(lambda: entry(running, 0) is None, 20, "the lost slot to leave the board")
        assert fe.counters["restarts"] == 0 and fe.planned == []
        procs.append(by_hand())  # one more by hand: a new id, never the old one
        wait_until(lambda: (entry(running, 1) or {}).get("state") == "ready", JOIN_S, "the second instance to join")
        complete(running)
        assert [i["id"] for i in running.cluster()] == [1]
    finally:
        running.stop()
        for p in procs:
            p.kill()
            p.wait(10)
