"""Faults with real processes: SIGKILL mid-prefill and mid-decode, SIGSTOP, bad messages, a wrong model,
a duplicate request id, and a frontend that dies. Mock instances give prefills and decodes known durations."""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import threading
import time

import msgspec
import openai
import pytest
import zmq

from ecoserve.live import messages as m
from ecoserve.live.launchers import instance_command
from ecoserve.live.shared import FrontendOptions
from ecoserve.sampling import SamplingParams
from tests.live.conftest import mock_args, start_cluster, wait_until, write_profile
from tests.live.fakes import FakeNoDG

# a step of <= 4 tokens (decodes) takes ~20 ms; a prompt of >= 8 tokens takes >= 1.5 s
PROFILE = [(1, 20.0), (4, 25.0), (8, 1500.0), (512, 2000.0)]
PROMPT = "The quick brown fox jumps over the lazy dog."
DEADLINE_S = 40.0


@pytest.fixture(scope="module")
def profile(tmp_path_factory):
    return write_profile(tmp_path_factory.mktemp("faults") / "profile.csv", PROFILE)


@pytest.fixture(scope="module")
def cluster(tiny_model, profile):
    running = start_cluster(tiny_model, lambda step_time, status_of: FakeNoDG([0, 1, 2, 3], status_of), 4,
                            lambda iid: mock_args(tiny_model, profile),
                            # restarts and migration off, no grace removal: this module watches the losses themselves
                            # (test_live_restart.py covers their replacement)
                            options=FrontendOptions(request_timeout_s=DEADLINE_S, max_restarts=0,
                                                    lost_grace_s=3600.0, max_migrations=0))
    yield running
    running.stop()


class Call(threading.Thread):
    """One completion in the background: its chunks, its result or its error, and how long it took."""

    def __init__(self, url: str, stream: bool, max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", timeout=DEADLINE_S + 20, max_retries=0)
        self.stream, self.max_tokens = stream, max_tokens
        self.chunks, self.result, self.error, self.elapsed = [], None, None, None
        self.start()

    def run(self) -> None:
        t0 = time.monotonic()
        try:
            kw = dict(model="tiny", prompt=PROMPT, max_tokens=self.max_tokens, temperature=0)
            if self.stream:
                for c in self.client.completions.create(stream=True, **kw):
                    self.chunks.append(c)
            else:
                self.result = self.client.completions.create(**kw)
        except Exception as e:  # what the client saw
            self.error = e
        self.elapsed = time.monotonic() - t0


def _where(cluster, before: set[str]) -> tuple[str, int]:
    """The newest request in the cluster and the instance it was dispatched to."""
    def found():
        return [r for r in list(cluster.engine.requests.values()) if r.request_id not in before and
                r.instance is not None]
    wait_until(found, 10, "the request to be dispatched")
    req = found()[0]
    return req.request_id, req.instance


def _pid(cluster, iid: int) -> int:
    return next(i["pid"] for i in cluster.cluster() if i["id"] == iid)


def _state(cluster, iid: int) -> str:
    return next(i["state"] for i in cluster.cluster() if i["id"] == iid)


def test_kill_mid_decode_ends_stream_with_error(cluster):
    """With stream migration off (max_migrations=0; test_live_migration covers it on)."""
    call = Call(cluster.url, stream=True, max_tokens=150)
    rid, iid = _where(cluster, set())
    wait_until(lambda: len(call.chunks) >= 3, 20, "tokens to stream")
    os.kill(_pid(cluster, iid), signal.SIGKILL)
    call.join(DEADLINE_S)
    assert not call.is_alive()
    assert isinstance(call.error, openai.APIError), call.error  # the OpenAI-shaped error event
    wait_until(lambda: _state(cluster, iid) == "lost", 5, "the loss to show in /cluster")
    assert cluster.engine.counters["instance_deaths"] >= 1


def test_kill_mid_prefill_reroutes(cluster):
    before = set(cluster.engine.requests)
    call = Call(cluster.url, stream=False, max_tokens=5)
    rid, iid = _where(cluster, before)
    time.sleep(0.3)  # inside its 1.5 s prefill
    reroutes = cluster.engine.counters["reroutes"]
    os.kill(_pid(cluster, iid), signal.SIGKILL)
    call.join(DEADLINE_S)
    assert call.error is None and call.result.usage.completion_tokens == 5
    assert cluster.engine.counters["reroutes"] == reroutes + 1
    assert _state(cluster, iid) == "lost"


def test_sigstop_is_a_missed_heartbeat(cluster):
    before = set(cluster.engine.requests)
    call = Call(cluster.url, stream=True, max_tokens=5)
    rid, iid = _where(cluster, before)
    pid = _pid(cluster, iid)
    os.kill(pid, signal.SIGSTOP)
    try:
        call.join(DEADLINE_S)
        assert call.error is None, call.error  # nothing had streamed: it completed elsewhere
        assert len([c for c in call.chunks if c.choices and c.choices[0].text is not None]) >= 1
        silence = cluster.engine.health.silence_allowed(cluster.engine.board[iid])
        assert silence < 2.0 + 2 * 3.6  # the heartbeat timeout + twice the profile's step at 2048 tokens
        assert call.elapsed < silence + 1.5 + 5  # heartbeat deadline + a prefill elsewhere + slack
        assert _state(cluster, iid) == "lost"
    finally:
        os.kill(pid, signal.SIGKILL)


def test_cluster_keeps_serving(cluster):
    call = Call(cluster.url, stream=False, max_tokens=4)
    call.join(DEADLINE_S)
    assert call.error is None and call.result.usage.completion_tokens == 4
    states = sorted(i["state"] for i in cluster.cluster())
    assert states == ["lost", "lost", "lost", "ready"]


def test_malformed_and_foreign_messages_are_dropped(cluster):
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(cluster.engine.address)
    try:
        sock.send(b"\x93garbage")  # not a message
        sock.send(msgspec.msgpack.encode({"type": "Nonsense", "x": 1}))  # unknown type
        st = m.Status(1, 0, cluster.engine.board.status_of(3))
        sock.send(m.encode(st))  # a status from a peer that never joined
        sock.send(m.encode(m.Ready(m.PROTOCOL_VERSION, "another-model", 1, "h", "tcp://127.0.0.1:1", 16, 16, 0,
                                   256, [(16, 1.0)])))
        assert sock.poll(5000), "the frontend did not answer the wrong model"
        assert isinstance(m.decode_to_instance(sock.recv()), m.Shutdown)
    finally:
        sock.close(0)
        ctx.term()
    assert cluster.engine.counters["refused_instances"] >= 1
    call = Call(cluster.url, stream=False, max_tokens=3)  # nothing else disturbed
    call.join(DEADLINE_S)
    assert call.error is None


def test_duplicate_request_id_refused(cluster):
    fe = cluster.engine

    async def twice():
        params = SamplingParams(max_tokens=2, temperature=0)
        first = fe.generate("dup", [5, 6, 7, 8, 9, 10, 11, 12], params)
        with pytest.raises(ValueError, match="already in use"):
            fe.generate("dup", [5, 6, 7], params)
        return [o async for o in first]

    outs = asyncio.run_coroutine_threadsafe(twice(), fe._loop).result(DEADLINE_S)
    assert outs[-1].finished and outs[-1].outputs[0].num_tokens == 2


def test_with_every_instance_lost_a_request_ends_at_once(cluster):
    """The controller cannot place it (the fake NoDG router has no instance left): a clear error, not the deadline."""
    last = next(i["id"] for i in cluster.cluster() if i["state"] == "ready")
    os.kill(_pid(cluster, last), signal.SIGKILL)
    wait_until(lambda: all(i["state"] == "lost" for i in cluster.cluster()), 15, "the last instance to be lost")
    call = Call(cluster.url, stream=False, max_tokens=3)
    call.join(DEADLINE_S)
    assert call.error is not None and "could not place" in str(call.error)
    assert "no instance is ready" in str(call.error) and "Error(" not in str(call.error)  # what is missing
    assert call.elapsed < 10 and not cluster.engine.requests


def test_instance_exits_when_the_frontend_dies(tiny_model, profile):
    """A frontend that goes away (here: a bare socket that welcomes the instance, then closes)."""
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    proc = subprocess.Popen(instance_command(f"tcp://127.0.0.1:{port}",
                                             mock_args(tiny_model, profile, "prefill_first",
                                                       "--reconnect-window", "2", "--cluster-auth", "none")),
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        assert router.poll(60000), "the instance did not connect"
        identity, frame = router.recv_multipart()
        assert isinstance(m.decode_to_frontend(frame), m.Ready)
        router.send_multipart([identity, m.encode(m.Welcome(0))])
        while not isinstance(m.decode_to_frontend(router.recv_multipart()[1]), m.Status):  # it has joined
            assert router.poll(30000), "the instance did not start its loop"
        router.close(0)  # the frontend is gone
        t0 = time.monotonic()
        assert proc.wait(timeout=15) == 3
        assert time.monotonic() - t0 < 10
    finally:
        if proc.poll() is None:
            proc.kill()
        ctx.term()


def test_a_step_longer_than_the_heartbeat_timeout_is_not_a_stall(tiny_model, tmp_path):
    """A 3-s prompt step (a one-thread CPU instance's 2048-token step takes seconds) beats no heartbeat
    for longer than the 0.5-s timeout and reads nothing for longer than its 2-s reconnection window:
    neither side may take that for a death."""
    slow = write_profile(tmp_path / "slow.csv", [(1, 20.0), (4, 25.0), (8, 3000.0), (512, 3000.0)])
    running = start_cluster(tiny_model, lambda step_time, status_of: FakeNoDG([0], status_of), 1,
                            lambda iid: mock_args(tiny_model, slow, "prefill_first", "--reconnect-window", "2"),
                            options=FrontendOptions(request_timeout_s=DEADLINE_S, heartbeat_timeout_s=0.5))
    try:
        call = Call(running.url, stream=False, max_tokens=3)
        call.join(DEADLINE_S)
        assert call.error is None, call.error
        assert call.result.usage.completion_tokens == 3 and call.elapsed > 3.0
        assert _state(running, 0) == "ready"
    finally:
        running.stop()
