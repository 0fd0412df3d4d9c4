"""Moving a request's KV blocks between instances over ZeroMQ raw buffers.

The header is a typed message; the K and V tensors follow as raw frames sent without copies
(zero-copy memoryviews, no pickle), so the same transport works across nodes. Sends run on a
thread of their own (`KVSender`, with its own sockets), so a peer that is gone costs the transfer
its deadline, never the instance loop. A receiver accepts a transfer only when the frontend told
it to expect that request and every frame has exactly the size the blocks need (`check_transfer`).
With a cluster key set both sides speak CURVE: the PULL socket is a server, each PUSH a client.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass

import msgspec
import zmq

from ecoserve.live.auth import ClusterAuth, make_client, make_server

logger = logging.getLogger(__name__)


class KVHeader(msgspec.Struct, frozen=True):
    request_id: str
    transfer_id: int
    src: int  # the sending instance's id
    num_tokens: int  # tokens whose KV the blocks hold
    nbytes: int


@dataclass(frozen=True)
class KVExpectation:
    """A transfer the frontend announced to this instance (the destination), before asking the source."""

    request_id: str
    transfer_id: int
    num_tokens: int
    src: int


@dataclass(frozen=True)
class KVOutcome:
    """What became of one export: `error` None when the frames left for the destination."""

    request_id: str
    transfer_id: int
    error: str | None


_header_decoder = msgspec.msgpack.Decoder(KVHeader)


def check_transfer(header: KVHeader, buffers: list[memoryview], expected: KVExpectation | None,
                   frame_sizes: list[int]) -> str | None:
    """Why a transfer must be refused (None: accept it); `frame_sizes`: what the expected blocks need, frame by
    frame. Nothing is allocated before this says yes."""
    if expected is None:
        return f"no transfer of request {header.request_id!r} is expected here"
    if header.transfer_id != expected.transfer_id or header.src != expected.src:
        return (f"transfer {header.transfer_id} from instance {header.src} is not the expected transfer "
                f"{expected.transfer_id} from instance {expected.src}")
    if header.num_tokens != expected.num_tokens:
        return f"{header.num_tokens} tokens of KV sent, {expected.num_tokens} expected"
    if len(buffers) != len(frame_sizes):
        return f"{len(buffers)} KV frames sent, the layout needs {len(frame_sizes)}"
    sizes = [b.nbytes for b in buffers]
    if sizes != frame_sizes:
        return f"KV frames of {sizes} bytes sent, the layout needs {frame_sizes}"
    if header.nbytes != sum(frame_sizes):
        return f"the header says {header.nbytes} bytes, the frames hold {sum(frame_sizes)}"
    return None


class ZmqKVConnector:
    """The PULL socket bound on this host (a frame larger than `max_frame_bytes`, or 64 KiB, cuts its sender off)."""

    def __init__(self, ctx: zmq.Context, host: str = "127.0.0.1", auth: ClusterAuth | None = None,
                 max_frame_bytes: int = 0) -> None:
        self.pull = ctx.socket(zmq.PULL)
        self.pull.setsockopt(zmq.LINGER, 0)
        self.pull.setsockopt(zmq.MAXMSGSIZE, max(max_frame_bytes, 1 << 16))
        if auth is not None:
            make_server(self.pull, auth)
        port = self.pull.bind_to_random_port(f"tcp://{host}")
        self.address = f"tcp://{host}:{port}"
        self.bytes_received = 0

    def receive(self) -> list[tuple[KVHeader, list[memoryview]]]:
        """Every transfer waiting now; one whose header does not decode is logged and dropped."""
        got = []
        while True:
            try:
                frames = self.pull.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return got
            try:
                header = _header_decoder.decode(frames[0].bytes)
            except (msgspec.DecodeError, msgspec.ValidationError) as e:
                logger.warning("dropped a malformed KV transfer (%d frames): %s", len(frames), e)
                continue
            buffers = [f.buffer for f in frames[1:]]
            self.bytes_received += sum(b.nbytes for b in buffers)
            got.append((header, buffers))

    def close(self) -> None:
        self.pull.close(0)


@dataclass(frozen=True)
class _Job:
    dst: str
    header: KVHeader
    buffers: list[memoryview]
    deadline: float


class KVSender:
    """Exports on a thread of their own, one PUSH socket per destination (zmq sockets stay in their thread)."""

    def __init__(self, ctx: zmq.Context, auth: ClusterAuth | None = None) -> None:
        self.ctx, self.auth = ctx, auth
        self._jobs: queue.Queue[_Job | None] = queue.Queue()
        self._outcomes: queue.Queue[KVOutcome] = queue.Queue()
        self._push: dict[str, zmq.Socket] = {}
        self.bytes_sent = 0
        self._thread = threading.Thread(target=self._run, name="kv-sender", daemon=True)
        self._thread.start()

    def submit(self, dst_address: str, header: KVHeader, buffers: list[memoryview], timeout_s: float) -> None:
        self._jobs.put(_Job(dst_address, header, buffers, time.monotonic() + timeout_s))

    def outcomes(self) -> list[KVOutcome]:
        """The exports finished since the last call (never blocks)."""
        done = []
        while True:
            try:
                done.append(self._outcomes.get_nowait())
            except queue.Empty:
                return done

    def close(self, timeout_s: float) -> None:
        """Stop after the jobs queued (each bounded by its deadline); its sockets close in its own thread."""
        self._jobs.put(None)
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            logger.warning("the KV sender did not stop within %.1f s", timeout_s)

    # ---- the sender thread -------------------------------------------------------------
    def _run(self) -> None:
        try:
            while (job := self._jobs.get()) is not None:
                self._outcomes.put(KVOutcome(job.header.request_id, job.header.transfer_id, self._send(job)))
        finally:
            for sock in self._push.values():
                sock.close(0)

    def _socket(self, dst: str) -> zmq.Socket:
        sock = self._push.get(dst)
        if sock is None:
            sock = self.ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.IMMEDIATE, 1)  # no queueing toward a peer that is not connected
            sock.setsockopt(zmq.LINGER, 0)
            if self.auth is not None:
                make_client(sock, self.auth)
            sock.connect(dst)
            self._push[dst] = sock
        return sock

    def _send(self, job: _Job) -> str | None:
        timeout_s = job.deadline - time.monotonic()
        rid = job.header.request_id
        if timeout_s <= 0:
            return f"KV transfer of {rid!r} to {job.dst}: its deadline passed before it could start"
        try:
            sock = self._socket(job.dst)
            sock.setsockopt(zmq.SNDTIMEO, max(int(timeout_s * 1000), 1))
            sock.send_multipart([msgspec.msgpack.encode(job.header), *job.buffers], copy=False)
        except zmq.ZMQError as e:
            self._drop(job.dst)  # a fresh socket next time: the peer may come back at this address
            if isinstance(e, zmq.Again):
                return f"KV transfer of {rid!r} to {job.dst}: no peer within {timeout_s:.1f} s"
            return f"KV transfer of {rid!r} to {job.dst} failed: {e}"
        self.bytes_sent += job.header.nbytes
        return None

    def _drop(self, dst: str) -> None:
        sock = self._push.pop(dst, None)
        if sock is not None:
            sock.close(0)
