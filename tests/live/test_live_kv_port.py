"""An instance's KV port and exports with a real model's KV layout: only an announced, well-formed transfer is
imported; each bad one is refused without allocating a block or hurting the instance; an export to a dead peer
fails on the sender thread while the instance keeps serving and beating."""
from __future__ import annotations

import socket
import time

import msgspec
import pytest
import zmq

from ecoserve.live import auth as cluster_auth
from ecoserve.live import messages as m
from ecoserve.live.kv import KVHeader
from ecoserve.sampling import SamplingParams
from tests.live.conftest import instance_args
from tests.live.peers import BareFrontend, push, start_instance

NUM_TOKENS = 20  # two blocks of 16
KV_SEND_TIMEOUT_S = 3.0


@pytest.fixture(scope="module")
def key_dir(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("kv_port") / "keys")
    cluster_auth.generate(path)
    return path


@pytest.fixture(scope="module")
def keys(key_dir):
    return cluster_auth.load(key_dir)


@pytest.fixture(scope="module")
def peer(tiny_model, key_dir, keys):
    """A bare frontend that has welcomed one real instance, and the instance's baseline free KV."""
    fe = BareFrontend(keys)
    proc = start_instance(fe.address, instance_args(tiny_model, "prefill_first", "--cluster-key-dir", key_dir,
                                                    "--heartbeat-interval", "0.2",
                                                    "--kv-send-timeout", str(KV_SEND_TIMEOUT_S)))
    try:
        fe.welcome(180)
        fe.baseline = fe.free_kv_tokens()
        yield fe
        assert proc.poll() is None, "the instance died"
    finally:
        proc.kill()
        proc.wait(30)
        fe.close()


def _frame_bytes(ready: m.Ready, num_tokens: int) -> int:
    blocks = -(-num_tokens // ready.block_size)
    return blocks * ready.block_size * ready.kv_bytes_per_token // 2


def _expect(fe: BareFrontend, rid: str, tid: int) -> None:
    fe.send(m.ExpectKV(rid, tid, NUM_TOKENS, 7))
    fe.pump(0.3)


def _header(rid: str, tid: int, nbytes: int, num_tokens: int = NUM_TOKENS) -> bytes:
    return msgspec.msgpack.encode(KVHeader(rid, tid, 7, num_tokens, nbytes))


def _failed(fe: BareFrontend, rid: str) -> m.RequestFailed:
    return fe.wait_for(lambda msg: isinstance(msg, m.RequestFailed) and msg.request_id == rid, 15,
                       f"the refusal of {rid}")


@pytest.fixture(scope="module")
def kv_push(peer, keys):
    ctx = zmq.Context()
    sock = push(ctx, peer.ready.kv_address, keys)
    yield sock
    sock.close(0)
    ctx.term()


def test_layout_reported(peer):
    assert peer.ready.version == m.PROTOCOL_VERSION and peer.ready.kv_dtype == "float32"
    assert peer.ready.kv_bytes_per_token > 0 and peer.baseline > 0


@pytest.mark.parametrize("case", ["wrong_size", "no_buffers", "fewer_buffers", "more_buffers", "wrong_tokens"])
def test_bad_transfer_refused_without_leak(peer, kv_push, case):
    rid, tid = f"bad-{case}", 100 + len(case)
    _expect(peer, rid, tid)
    size = _frame_bytes(peer.ready, NUM_TOKENS)
    frames = {"wrong_size": [b"\0" * (size - 4), b"\0" * size], "no_buffers": [],
              "fewer_buffers": [b"\0" * size], "more_buffers": [b"\0" * size] * 3,
              "wrong_tokens": [b"\0" * size, b"\0" * size]}[case]
    tokens = 10 * NUM_TOKENS if case == "wrong_tokens" else NUM_TOKENS  # a header asking for more blocks
    kv_push.send_multipart([_header(rid, tid, sum(len(f) for f in frames), tokens), *frames])
    assert "refused" in _failed(peer, rid).reason
    assert not any(isinstance(msg, m.ImportedKV) and msg.request_id == rid for _, msg in peer.received)
    assert peer.free_kv_tokens() == peer.baseline


def test_unknown_request_refused(peer, kv_push):
    size = _frame_bytes(peer.ready, NUM_TOKENS)
    start = len(peer.received)
    kv_push.send_multipart([_header("nobody", 1, 2 * size), b"\0" * size, b"\0" * size])
    assert peer.free_kv_tokens() == peer.baseline
    assert not any(isinstance(msg, (m.ImportedKV, m.RequestFailed)) for _, msg in peer.received[start:])


def test_transfer_without_the_key_never_arrives(peer):
    rid = "keyless"
    _expect(peer, rid, 5)
    ctx = zmq.Context()
    sock = push(ctx, peer.ready.kv_address, cluster_auth.new_key_set())
    try:
        try:
            sock.send_multipart([_header(rid, 5, 0), b"\0"], zmq.NOBLOCK)  # bad frames: a refusal if it got in
        except zmq.Again:
            pass
        peer.pump(2.0)
    finally:
        sock.close(0)
        ctx.term()
    peer.pump(1.0)
    assert not any(getattr(msg, "request_id", None) == rid for _, msg in peer.received)
    peer.send(m.Abort([rid]))


def test_announced_transfer_imported_then_freed(peer, kv_push):
    rid, tid = "good", 42
    _expect(peer, rid, tid)
    size = _frame_bytes(peer.ready, NUM_TOKENS)
    kv_push.send_multipart([_header(rid, tid, 2 * size), b"\1" * size, b"\1" * size])
    got = peer.wait_for(lambda msg: isinstance(msg, (m.ImportedKV, m.RequestFailed)) and msg.request_id == rid,
                        15, "the import")
    assert isinstance(got, m.ImportedKV) and got.nbytes == 2 * size
    assert peer.free_kv_tokens() == peer.baseline - 2 * peer.ready.block_size
    peer.send(m.Abort([rid]))
    assert peer.free_kv_tokens() == peer.baseline


def test_still_serving(peer):
    peer.send(m.AddRequest(1, "after", [5, 6, 7, 8, 9], SamplingParams(max_tokens=4, temperature=0)))
    peer.wait_for(lambda msg: isinstance(msg, m.Outputs) and any(d.request_id == "after" and d.finish_reason
                                                                 for d in msg.deltas), 30, "the request to finish")
    assert peer.free_kv_tokens() == peer.baseline


def _dead_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def test_export_to_dead_peer_fails_while_instance_serves(peer):
    rid = "export"
    peer.send(m.AddRequest(2, rid, list(range(5, 25)), SamplingParams(max_tokens=1, temperature=0), pin_kv=True))
    paused = peer.wait_for(lambda msg: isinstance(msg, m.Paused) and msg.request_id == rid, 30, "the pause")
    held = peer.free_kv_tokens()
    assert held < peer.baseline  # its blocks are pinned for the export
    start = len(peer.received)
    t0 = time.monotonic()
    peer.send(m.ExportKV(rid, paused.num_tokens, _dead_address(), 9))
    peer.send(m.AddRequest(3, "meanwhile", [5, 6, 7], SamplingParams(max_tokens=8, temperature=0)))
    failed = _failed(peer, rid)
    elapsed = time.monotonic() - t0
    assert "no peer" in failed.reason and elapsed < KV_SEND_TIMEOUT_S + 5
    window = [(t, msg) for t, msg in peer.received[start:]]
    beats = [t for t, msg in window if isinstance(msg, m.Heartbeat)]
    assert len(beats) >= 5 and max(b - a for a, b in zip(beats, beats[1:])) < 1.5  # the loop never stopped
    assert any(isinstance(msg, m.Outputs) and any(d.request_id == "meanwhile" and d.finish_reason for d in msg.deltas)
               for _, msg in window)  # and served another request during the export
    assert peer.free_kv_tokens() == peer.baseline  # the pinned blocks were released
