"""Moving a request's KV blocks between instances over ZeroMQ raw buffers.

The header is a typed message; the K and V tensors follow as raw frames sent without copies
(zero-copy memoryviews, no pickle), so the same transport works across nodes. A peer that is gone
means a send timeout, never a hang.
"""
from __future__ import annotations

import logging

import msgspec
import zmq

logger = logging.getLogger(__name__)


class KVHeader(msgspec.Struct, frozen=True):
    request_id: str
    transfer_id: int
    src: int  # the sending instance's id
    num_tokens: int  # tokens whose KV the blocks hold
    nbytes: int


_header_decoder = msgspec.msgpack.Decoder(KVHeader)


class ZmqKVConnector:
    """PULL socket bound on this host; one PUSH socket per destination, connected on first use."""

    def __init__(self, ctx: zmq.Context, host: str = "127.0.0.1") -> None:
        self.ctx = ctx
        self.pull = ctx.socket(zmq.PULL)
        self.pull.setsockopt(zmq.LINGER, 0)
        port = self.pull.bind_to_random_port(f"tcp://{host}")
        self.address = f"tcp://{host}:{port}"
        self._push: dict[str, zmq.Socket] = {}
        self.bytes_sent = 0
        self.bytes_received = 0

    def _socket(self, dst: str, timeout_s: float) -> zmq.Socket:
        sock = self._push.get(dst)
        if sock is None:
            sock = self.ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.IMMEDIATE, 1)  # no queueing toward a peer that is not connected
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(dst)
            self._push[dst] = sock
        sock.setsockopt(zmq.SNDTIMEO, int(timeout_s * 1000))
        return sock

    def send(self, dst_address: str, header: KVHeader, buffers: list[memoryview], timeout_s: float) -> None:
        sock = self._socket(dst_address, timeout_s)
        try:
            sock.send_multipart([msgspec.msgpack.encode(header), *buffers], copy=False)
        except zmq.Again:
            sock.close(0)  # a fresh socket next time: the peer may come back at this address
            del self._push[dst_address]
            raise TimeoutError(f"KV transfer of {header.request_id!r} to {dst_address}: no peer within "
                               f"{timeout_s:.1f} s") from None
        self.bytes_sent += header.nbytes

    def receive(self) -> list[tuple[KVHeader, list[memoryview]]]:
        got = []
        while True:
            try:
                frames = self.pull.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return got
            try:
                header = _header_decoder.decode(frames[0].bytes)
            except (msgspec.DecodeError, msgspec.ValidationError) as e:
                logger.warning("dropped a malformed KV transfer: %s", e)
                continue
            self.bytes_received += header.nbytes
            got.append((header, [f.buffer for f in frames[1:]]))

    def close(self) -> None:
        for sock in self._push.values():
            sock.close(0)
        self.pull.close(0)
