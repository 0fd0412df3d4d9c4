"""The cluster's CURVE keys and the ZeroMQ socket roles that use them (pyzmq's own `zmq.auth`).

One key set is one trust domain: a server key pair (the frontend's ROUTER and every instance's KV
PULL socket present it) and a client key pair (every instance's DEALER and KV PUSH sockets present
it). A process that binds runs a ZAP authenticator that admits only the cluster's client public
key(s), so a peer without the key set cannot complete a handshake: it sends and receives nothing.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

logger = logging.getLogger(__name__)

SERVER_NAME = "server"  # server.key (public) and server.key_secret in a key directory
CLIENT_NAME = "client"


@dataclass(frozen=True)
class KeyPair:
    public: bytes  # Z85, 40 bytes
    secret: bytes | None = None  # None where only the public key is known


@dataclass(frozen=True)
class ClusterAuth:
    """The key material a cluster process needs (picklable: a Ray actor gets it as a call argument)."""

    server: KeyPair
    client: KeyPair
    allowed_clients: tuple[bytes, ...] = ()  # public keys admitted by a binding socket; () means the client's

    def admitted(self) -> frozenset[bytes]:
        return frozenset(self.allowed_clients or (self.client.public,))


def new_key_set() -> ClusterAuth:
    """A fresh key set in memory only (for instances that get it as a call argument, e.g. Ray actors)."""
    return ClusterAuth(KeyPair(*zmq.curve_keypair()), KeyPair(*zmq.curve_keypair()))


def generate(directory: str) -> ClusterAuth:
    """Write a fresh key set into `directory` (created mode 0700; secret files mode 0600)."""
    os.makedirs(directory, mode=0o700, exist_ok=True)
    os.chmod(directory, 0o700)
    for name in (SERVER_NAME, CLIENT_NAME):
        _, secret_file = zmq.auth.create_certificates(directory, name)
        os.chmod(secret_file, 0o600)
    return load(directory)


def load(directory: str) -> ClusterAuth:
    """The key set in `directory` (as `generate` or `ecoserve keys generate` wrote it); ValueError if incomplete."""
    pairs = []
    for name in (SERVER_NAME, CLIENT_NAME):
        path = os.path.join(directory, f"{name}.key_secret")
        if not os.path.isfile(path):
            raise ValueError(f"no cluster key {path!r}: create a key set with `ecoserve keys generate {directory}`")
        public, secret = zmq.auth.load_certificate(path)
        if secret is None:
            raise ValueError(f"{path!r} holds no secret key")
        pairs.append(KeyPair(public, secret))
    return ClusterAuth(pairs[0], pairs[1])


def make_server(sock: zmq.Socket, auth: ClusterAuth) -> None:
    """A socket that binds and admits only the cluster's clients (an authenticator must run in its context)."""
    sock.curve_secretkey = auth.server.secret
    sock.curve_publickey = auth.server.public
    sock.curve_server = True


def make_client(sock: zmq.Socket, auth: ClusterAuth) -> None:
    """A socket that connects to a cluster server and presents the cluster's client key."""
    sock.curve_secretkey = auth.client.secret
    sock.curve_publickey = auth.client.public
    sock.curve_serverkey = auth.server.public


class _AdmittedKeys:
    """The authenticator's credentials provider: a client public key is admitted or not."""

    def __init__(self, keys: frozenset[bytes]) -> None:
        self.keys = keys

    def callback(self, domain: str, key: bytes) -> bool:
        if key in self.keys:
            return True
        logger.warning("refused a CURVE client whose key is not the cluster's (%s...)",
                       key[:8].decode(errors="replace"))
        return False


def start_authenticator(ctx: zmq.Context, auth: ClusterAuth) -> ThreadAuthenticator:
    """A ZAP handler in its own thread (a busy event loop or engine step cannot delay handshakes)."""
    if type(ctx) is not zmq.Context:
        ctx = zmq.Context.shadow(ctx.underlying)  # an asyncio context: the same libzmq context, sync sockets
    authenticator = ThreadAuthenticator(ctx, log=logger)
    authenticator.start()
    authenticator.configure_curve_callback("*", _AdmittedKeys(auth.admitted()))
    return authenticator
