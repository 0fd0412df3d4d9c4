"""The authenticated cluster transport with real processes: `ecoserve keys generate` keys a frontend and a
hand-started instance; a peer without the cluster's key receives nothing and changes nothing; a keyed peer with
another KV layout is refused; news of a request from an instance that does not run it is dropped and counted;
an instance whose auth does not match the frontend's exits with a clear error."""
from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time

import msgspec
import pytest
import zmq

from ecoserve.live import auth as cluster_auth
from ecoserve.live import messages as m
from ecoserve.live.shared import FrontendOptions
from ecoserve.sampling import SamplingParams
from tests.live.conftest import mock_args, model_facts, serve, wait_until, write_profile
from tests.live.fakes import FakeNoDG
from tests.live.peers import BareFrontend, dealer, start_instance

PROFILE = [(1, 20.0), (4, 25.0), (8, 100.0), (512, 200.0)]
DEADLINE_S = 40.0


@pytest.fixture(scope="module")
def profile(tmp_path_factory):
    return write_profile(tmp_path_factory.mktemp("auth") / "profile.csv", PROFILE)


@pytest.fixture(scope="module")
def key_dir(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("auth") / "keys")
    done = subprocess.run([sys.executable, "-m", "ecoserve.cli", "keys", "generate", path], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return path


@pytest.fixture(scope="module")
def cluster(tiny_model, profile, key_dir):
    """A frontend keyed with `key_dir`, and one instance started by hand with `--cluster-key-dir key_dir`."""
    from ecoserve.live.frontend import ClusterEngine

    engine = ClusterEngine(model_facts(tiny_model), lambda step_time, status_of: FakeNoDG([0], status_of), [0], None,
                           FrontendOptions(request_timeout_s=DEADLINE_S, auth=cluster_auth.load(key_dir)))
    box: dict = {}
    thread = threading.Thread(target=lambda: box.setdefault("running", serve(engine)), daemon=True)
    thread.start()
    wait_until(lambda: engine.address is not None, 60, "the frontend to listen")
    proc = start_instance(engine.address, mock_args(tiny_model, profile, "prefill_first", "--cluster-key-dir",
                                                    key_dir))
    try:
        thread.join(240)
        assert "running" in box, "the hand-started instance did not join"
        yield box["running"]
    finally:
        if "running" in box:
            box["running"].stop()
        proc.kill()
        proc.wait(30)


def _generate(fe, rid: str, max_tokens: int):
    async def collect():
        return [o async for o in fe.generate(rid, [5, 6, 7, 8, 9, 10], SamplingParams(max_tokens=max_tokens,
                                                                                      temperature=0))]
    return asyncio.run_coroutine_threadsafe(collect(), fe._loop)


def _snapshot(fe) -> tuple:
    return (sorted(fe.board.instances), fe.counters["refused_instances"], fe.counters["rejected_messages"],
            sorted(fe.requests))


def test_hand_started_instance_joined_with_generated_keys(cluster):
    fe = cluster.engine
    assert fe.board[0].state == "ready" and fe.board[0].ready.kv_dtype == "none"
    outs = _generate(fe, "joined", 3).result(DEADLINE_S)
    assert outs[-1].finished and outs[-1].outputs[0].num_tokens == 3


@pytest.mark.parametrize("keys", ["none", "other"])
def test_impostor_without_the_cluster_key_gets_nothing(cluster, keys):
    fe = cluster.engine
    before = _snapshot(fe)
    ctx = zmq.Context()
    sock = dealer(ctx, fe.address, None if keys == "none" else cluster_auth.new_key_set())
    try:
        ready = msgspec.structs.replace(fe.board[0].ready, pid=1)  # a valid Ready in every other way
        for _ in range(3):
            try:
                sock.send(m.encode(ready), zmq.NOBLOCK)
            except zmq.Again:
                pass  # nothing could even be queued: no less safe
        assert not sock.poll(3000), "the frontend answered a peer without the cluster key"
    finally:
        sock.close(0)
        ctx.term()
    assert _snapshot(fe) == before
    outs = _generate(fe, f"after-{keys}", 3).result(DEADLINE_S)
    assert outs[-1].outputs[0].num_tokens == 3


def test_keyed_peer_with_another_kv_layout_refused(cluster, key_dir):
    fe = cluster.engine
    instances, refused = sorted(fe.board.instances), fe.counters["refused_instances"]
    ctx = zmq.Context()
    sock = dealer(ctx, fe.address, cluster_auth.load(key_dir))
    try:
        sock.send(m.encode(msgspec.structs.replace(fe.board[0].ready, pid=2, block_size=32)))
        assert sock.poll(10000), "no answer to a keyed peer"
        assert isinstance(m.decode_to_instance(sock.recv()), m.Shutdown)
    finally:
        sock.close(0)
        ctx.term()
    assert fe.counters["refused_instances"] == refused + 1
    assert sorted(fe.board.instances) == instances


def test_news_of_another_instances_request_dropped(cluster, key_dir):
    """A keyed peer that joined (so messages from it are read) cannot fail, pause or write into a request
    that instance 0 runs."""
    fe = cluster.engine
    rid = "victim"
    fut = _generate(fe, rid, 120)
    wait_until(lambda: rid in fe.requests and fe.requests[rid].instance == 0 and fe.requests[rid].streamed, 20,
               "the request to stream from instance 0")
    rejected = fe.counters["rejected_messages"]
    ctx = zmq.Context()
    sock = dealer(ctx, fe.address, cluster_auth.load(key_dir))
    try:
        sock.send(m.encode(msgspec.structs.replace(fe.board[0].ready, pid=3)))
        assert sock.poll(10000) and isinstance(m.decode_to_instance(sock.recv()), m.Welcome)
        sock.send(m.encode(m.RequestFailed(rid, "forged")))
        sock.send(m.encode(m.Outputs([m.Delta(rid, 0, [1], "FORGED", "stop")])))
        sock.send(m.encode(m.Paused(rid, 3)))
        sock.send(m.encode(m.ImportedKV(rid, 1, 0, 10)))
        wait_until(lambda: fe.counters["rejected_messages"] >= rejected + 3, 10, "the forged messages to be dropped")
    finally:
        sock.close(0)
        ctx.term()
    outs = fut.result(DEADLINE_S)
    final = outs[-1].outputs[0]
    assert outs[-1].finished and final.num_tokens == 120 and "FORGED" not in final.text
    assert final.finish_reason == "length"


def test_mismatched_auth_exits_with_a_clear_error(cluster, tiny_model, profile, tmp_path):
    """Instance without keys, with another key set, and a keyed instance against an unkeyed frontend."""
    other = str(tmp_path / "other")
    cluster_auth.generate(other)
    plain = BareFrontend(None)
    cases = {"none vs curve": (cluster.engine.address, ["--cluster-auth", "none"]),
             "other keys": (cluster.engine.address, ["--cluster-key-dir", other]),
             "curve vs none": (plain.address, ["--cluster-key-dir", other])}
    procs = {name: start_instance(addr, mock_args(tiny_model, profile, "prefill_first", *extra),
                                  stderr=subprocess.PIPE) for name, (addr, extra) in cases.items()}
    try:
        t0 = time.monotonic()
        for name, proc in procs.items():
            _, err = proc.communicate(timeout=150)
            assert proc.returncode not in (0, None), name
            assert b"cannot join the frontend" in err or b"no welcome" in err, (name, err[-2000:])
        assert time.monotonic() - t0 < 150
        plain.pump(0.5)
        assert plain.ready is None  # the keyed instance never reached the unkeyed frontend's application
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
        plain.close()
    assert cluster.engine.board[0].state == "ready"


def test_flood_of_keyed_readys_is_rate_limited(cluster, key_dir):
    """20 joins by hand at once: at most 8 are welcomed (the board grows by at most 8), the rest refused."""
    fe = cluster.engine
    size, refused = len(fe.board.instances), fe.counters["refused_instances"]
    keys = cluster_auth.load(key_dir)
    ctx = zmq.Context()
    socks = [dealer(ctx, fe.address, keys) for _ in range(20)]
    try:
        for i, sock in enumerate(socks):
            sock.send(m.encode(msgspec.structs.replace(fe.board[0].ready, pid=100 + i)))
        answers = []
        for sock in socks:
            assert sock.poll(10000), "a join went unanswered"
            answers.append(type(m.decode_to_instance(sock.recv())))
    finally:
        for sock in socks:
            sock.close(0)
        ctx.term()
    welcomed = answers.count(m.Welcome)
    assert welcomed <= 8 and answers.count(m.Shutdown) == 20 - welcomed
    assert len(fe.board.instances) <= size + 8
    assert fe.counters["refused_instances"] == refused + 20 - welcomed
    outs = _generate(fe, "after-flood", 3).result(DEADLINE_S)
    assert outs[-1].outputs[0].num_tokens == 3
