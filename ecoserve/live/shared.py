"""What the cluster frontend shares with its collaborators (dispatcher, receiver, health watch).

The frontend owns the socket, the board of instances, the requests and the controller; the
collaborators reach them only through this interface, so none of them imports the frontend.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol

from ecoserve.cluster import events as ev
from ecoserve.live import messages as m
from ecoserve.live.auth import ClusterAuth
from ecoserve.live.board import InstanceBoard, InstanceHandle
from ecoserve.live.requests import LiveRequest


@dataclass(frozen=True)
class FrontendOptions:
    bind: str = "tcp://127.0.0.1:0"  # the port instances connect to (0: any free port)
    heartbeat_timeout_s: float = 2.0  # an instance silent this long is lost
    ping_interval_s: float = 0.5
    request_timeout_s: float = 600.0  # every request ends by then
    kv_transfer_timeout_s: float = 10.0
    ready_timeout_s: float = 300.0  # launched instances that have not joined by then are lost
    max_waiting: int | None = None
    max_migrations: int = 2  # a stream whose instance is lost moves on at most this often (0: it fails)
    restart_backoff_s: float = 1.0  # a lost launched instance is restarted after this, doubling per restart
    max_restarts: int = 5  # restarts per instance (0: lost instances stay lost)
    lost_grace_s: float = 60.0  # a lost instance that will not be restarted leaves the board after this
    auth: ClusterAuth | None = None  # the cluster's CURVE keys; None: unauthenticated (`--cluster-auth none`)


class Frontend(Protocol):
    board: InstanceBoard
    requests: dict[str, LiveRequest]
    max_model_len: int  # the model's: a request's prompt, output and budget fit in it

    def send(self, h: InstanceHandle, msg: m.Msg) -> None:
        """To the instance's connection; a failed send loses the instance."""
        ...

    def post(self, event: ev.Event) -> None:
        """An event to the controller; its actions are carried out at once."""
        ...

    def end(self, req: LiveRequest, error: BaseException | None = None) -> None:
        """Forget a request; abort it wherever it still runs; hand `error` to its client."""
        ...

    def fail(self, req: LiveRequest, error: BaseException) -> None:
        """End a request with `error` and tell the controller it is gone."""
        ...

    def deliver(self, req: LiveRequest) -> None:
        """The request's news to its client, unless its instance's output is held (a finished one is flushed)."""
        ...

    def release(self, req: LiveRequest) -> None:
        """Hand the client what the output hold kept from it (its instance streams again)."""
        ...

    def call_later(self, delay_s: float, fn: Callable[..., None], *args: Any) -> None: ...

    def check_ready(self) -> None:
        """Once no launched instance is still starting: build the controller (at most once)."""
        ...

    def drain(self) -> int:
        """Handle every message already queued on the instances' socket; how many there were."""
        ...
