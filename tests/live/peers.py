"""Test peers that speak the cluster protocol by hand: a bare frontend ROUTER and a bare instance DEALER,
with or without the cluster's CURVE keys, to drive an instance or a frontend into the cases a real peer avoids."""
from __future__ import annotations

import os
import subprocess
import time

import zmq

from ecoserve.live import auth as cluster_auth
from ecoserve.live import messages as m
from ecoserve.live.launchers import instance_command


class BareFrontend:
    """A ROUTER bound on loopback (a CURVE server with `auth`); it welcomes one instance and records its messages."""

    def __init__(self, auth: cluster_auth.ClusterAuth | None) -> None:
        self.ctx = zmq.Context()
        self.authenticator = cluster_auth.start_authenticator(self.ctx, auth) if auth is not None else None
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # as the real frontend: a reconnection takes over
        if auth is not None:
            cluster_auth.make_server(self.sock, auth)
        self.address = f"tcp://127.0.0.1:{self.sock.bind_to_random_port('tcp://127.0.0.1')}"
        self.identity: bytes | None = None
        self.ready: m.Ready | None = None
        self.received: list[tuple[float, m.Msg]] = []
        self.status: m.Status | None = None

    def welcome(self, timeout: float, instance_id: int = 0) -> m.Ready:
        deadline = time.monotonic() + timeout
        while self.ready is None:
            assert time.monotonic() < deadline, "the instance did not send its Ready"
            self.pump(0.2)
        self.send(m.Welcome(instance_id))
        return self.ready

    def send(self, msg: m.Msg) -> None:
        self.sock.send_multipart([self.identity, m.encode(msg)])

    def pump(self, duration: float) -> None:
        """Read whatever arrives for `duration` seconds."""
        end = time.monotonic() + duration
        while (left := end - time.monotonic()) > 0:
            if not self.sock.poll(max(int(left * 1000), 1)):
                continue
            identity, frame = self.sock.recv_multipart()
            msg = m.decode_to_frontend(frame)
            if isinstance(msg, m.Ready):
                self.identity, self.ready = identity, msg
            elif isinstance(msg, m.Status):
                self.status = msg
            self.received.append((time.monotonic(), msg))

    def wait_for(self, predicate, timeout: float, what: str) -> m.Msg:
        """The first message from now on for which `predicate` holds."""
        start = len(self.received)
        deadline = time.monotonic() + timeout
        while True:
            for _, msg in self.received[start:]:
                if predicate(msg):
                    return msg
            start = len(self.received)
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            self.pump(0.1)

    def free_kv_tokens(self, settle_s: float = 0.8) -> int:
        """The instance's free KV once what was sent has settled (its latest status after `settle_s`)."""
        self.pump(settle_s)
        return self.status.status.free_kv_tokens

    def close(self) -> None:
        self.sock.close(0)
        if self.authenticator is not None:
            self.authenticator.stop()
        self.ctx.term()


def start_instance(connect: str, args: list[str], stderr=None) -> subprocess.Popen:
    return subprocess.Popen(instance_command(connect, args), env={**os.environ, "OMP_NUM_THREADS": "1"},
                            stdin=subprocess.DEVNULL, stderr=stderr)


def dealer(ctx: zmq.Context, address: str, auth: cluster_auth.ClusterAuth | None) -> zmq.Socket:
    """An instance-side socket connected to `address`, presenting `auth`'s client key (None: no CURVE)."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if auth is not None:
        cluster_auth.make_client(sock, auth)
    sock.connect(address)
    return sock


def push(ctx: zmq.Context, address: str, auth: cluster_auth.ClusterAuth | None) -> zmq.Socket:
    """A KV sender's socket toward an instance's KV receiver."""
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDTIMEO, 5000)
    if auth is not None:
        cluster_auth.make_client(sock, auth)
    sock.connect(address)
    return sock
