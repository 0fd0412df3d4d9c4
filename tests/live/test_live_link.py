"""The frontend<->instance connection under load, with real processes over CURVE (the default): a burst of
thousands of queued messages to a busy instance does not lose it; a frontend event loop blocked for 10 s does
not make instances exit or be declared lost; a frontend that is gone makes its instance exit within the
reconnection window, and one stopped for less than the window keeps its instance."""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import pytest

from ecoserve.live import auth as cluster_auth
from ecoserve.live import messages as m
from ecoserve.sampling import SamplingParams
from tests.live.conftest import mock_args, start_strategy, wait_until, write_profile
from tests.live.peers import BareFrontend, start_instance

# decodes take ~20 ms; a prompt of >= 8 tokens takes ~3 s (a busy instance that reads nothing meanwhile)
PROFILE = [(1, 20.0), (4, 25.0), (8, 3000.0), (512, 3000.0)]
DEADLINE_S = 60.0
PROMPT = list(range(5, 25))


@pytest.fixture(scope="module")
def profile(tmp_path_factory):
    return write_profile(tmp_path_factory.mktemp("link") / "profile.csv", PROFILE)


@pytest.fixture(scope="module")
def cluster(tiny_model, profile):
    running = start_strategy(tiny_model, "vllm", 1, mock_args(tiny_model, profile))
    assert running.engine.opts.auth is not None  # CURVE by default, with a fresh key set per run
    key_dir = running.engine.launcher.key_dir
    assert os.stat(key_dir).st_mode & 0o777 == 0o700
    yield running
    running.stop()
    assert not os.path.exists(key_dir)  # removed at shutdown


def _generate(fe, rid: str, max_tokens: int):
    async def collect():
        return [o async for o in fe.generate(rid, PROMPT, SamplingParams(max_tokens=max_tokens, temperature=0))]
    return asyncio.run_coroutine_threadsafe(collect(), fe._loop)


def _alive(fe) -> list[int]:
    return [iid for iid, h in fe.board.instances.items()
            if h.state == "ready" and fe.launcher.exit_code(iid) is None]


def test_burst_to_a_busy_instance_does_not_lose_it(cluster):
    """Thousands of messages queue for an instance inside a 3-s step; none is dropped (the request sent after
    them is served) and the instance is not lost."""
    fe = cluster.engine
    deaths = fe.counters["instance_deaths"]
    first = _generate(fe, "busy", 3)
    wait_until(lambda: "busy" in fe.requests and fe.requests["busy"].instance is not None, 20, "the dispatch")
    h = fe.board[fe.requests["busy"].instance]
    # inside its prefill step: it has read the request and beats no more (its heartbeat interval is 0.2 s)
    wait_until(lambda: time.monotonic() - h.last_heard > 0.6, 20, "the instance to be inside its step")
    noise = ["n" * 1000 + str(i) for i in range(10)]  # ~10 KB a message: far past any socket buffer
    after: dict = {}

    def burst() -> None:
        for _ in range(5000):  # > 1000 (the default high-water mark) while the instance is inside its step
            fe.send(h, m.Abort(noise))
        after["future"] = _generate(fe, "after-burst", 3)  # its AddRequest queues behind the burst

    fe._loop.call_soon_threadsafe(burst)
    outs = first.result(DEADLINE_S)
    assert outs[-1].finished and outs[-1].outputs[0].num_tokens == 3
    wait_until(lambda: "future" in after, 10, "the burst")
    assert after["future"].result(DEADLINE_S)[-1].outputs[0].num_tokens == 3
    assert fe.counters["instance_deaths"] == deaths and h.state == "ready"


def test_blocked_event_loop_loses_no_instance(cluster):
    fe = cluster.engine
    deaths = fe.counters["instance_deaths"]
    assert len(_alive(fe)) == 1
    assert max(fe.health.silence_allowed(h) for h in fe.board.instances.values()) < 10.0
    # a frontend busy for 10 s: longer than the old 5-s silence and than the instances' 8-s heartbeat allowance
    fe._loop.call_soon_threadsafe(time.sleep, 10.0)
    time.sleep(10.5)
    time.sleep(3.0)  # the deadlines after the block
    assert fe.counters["instance_deaths"] == deaths
    assert len(_alive(fe)) == 1
    outs = _generate(fe, "after-block", 3).result(DEADLINE_S)
    assert outs[-1].outputs[0].num_tokens == 3


def test_instance_exits_when_its_frontend_is_gone(tiny_model, profile, tmp_path):
    key_dir = str(tmp_path / "keys")
    fe = BareFrontend(cluster_auth.generate(key_dir))
    proc = start_instance(fe.address, mock_args(tiny_model, profile, "prefill_first", "--cluster-key-dir", key_dir,
                                                "--reconnect-window", "3"))
    try:
        fe.welcome(120)
        fe.pump(4.0)  # no application ping at all for longer than the window: the connection is what counts
        assert proc.poll() is None
        fe.close()  # the frontend is gone
        t0 = time.monotonic()
        assert proc.wait(timeout=30) == 3
        assert time.monotonic() - t0 < 3 + 5
    finally:
        if proc.poll() is None:
            proc.kill()


FRONTEND_PROCESS = """
import sys
from ecoserve.live import auth
from tests.live.peers import BareFrontend
fe = BareFrontend(auth.load(sys.argv[1]))
print(fe.address, flush=True)
fe.welcome(180)
print("welcomed", flush=True)
while True:
    fe.pump(1.0)
"""


def test_stopped_frontend_within_the_window_keeps_its_instance(tiny_model, profile, tmp_path):
    """A frontend process SIGSTOPped for 6 s (longer than the old 5-s silence and the 3-s ZMTP heartbeat
    timeout, shorter than the 10-s window) keeps its instance; SIGKILLed, the instance exits within the window."""
    key_dir = str(tmp_path / "keys")
    cluster_auth.generate(key_dir)
    frontend = subprocess.Popen([sys.executable, "-c", FRONTEND_PROCESS, key_dir], stdout=subprocess.PIPE,
                                text=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
    proc = None
    try:
        address = frontend.stdout.readline().strip()
        assert address.startswith("tcp://"), address
        proc = start_instance(address, mock_args(tiny_model, profile, "prefill_first", "--cluster-key-dir", key_dir,
                                                 "--reconnect-window", "10"))
        assert frontend.stdout.readline().strip() == "welcomed"
        os.kill(frontend.pid, signal.SIGSTOP)
        time.sleep(6.0)
        os.kill(frontend.pid, signal.SIGCONT)
        time.sleep(4.0)
        assert proc.poll() is None, "the instance gave up on a frontend that was only stopped"
        frontend.kill()
        t0 = time.monotonic()
        assert proc.wait(timeout=40) == 3
        assert time.monotonic() - t0 < 10 + 3 + 5  # the window + the ZMTP heartbeat timeout + slack
    finally:
        for p in (frontend, proc):
            if p is not None and p.poll() is None:
                os.kill(p.pid, signal.SIGCONT)
                p.kill()
