"""The frontend's two background tasks: reading the instances' socket, and watching them.

The watchdog runs every 100 ms: it pings, declares instances lost (process exit, missed heartbeat,
never joined), ends requests past their deadline, and builds the controller once every launched
instance has joined or been lost.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from ecoserve.cluster import events as ev
from ecoserve.cluster.profile import StepTimeTable
from ecoserve.engine.async_engine import EngineDeadError
from ecoserve.live import messages as m
from ecoserve.live.actions import apply_actions, assign_roles
from ecoserve.live.board import InstanceHandle
from ecoserve.live.errors import InstanceLostError, RequestTimeoutError
from ecoserve.live.receive import handle_frame

if TYPE_CHECKING:
    from ecoserve.live.frontend import ClusterEngine

logger = logging.getLogger(__name__)

WATCH_PERIOD_S = 0.1


async def receive(fe: "ClusterEngine") -> None:
    """Every message from every instance, in order per instance; a bad one is logged and dropped."""
    while True:
        try:
            frames = await fe.sock.recv_multipart()
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.exception("receive failed")
            await asyncio.sleep(0.01)
            continue
        if len(frames) != 2:
            logger.warning("dropped a message of %d frames", len(frames))
            continue
        try:
            handle_frame(fe, frames[0], frames[1])
        except Exception:
            logger.exception("handling a message from an instance failed")


async def watch(fe: "ClusterEngine") -> None:
    """Heartbeats, process exits, deadlines."""
    last_ping = 0.0
    while True:
        await asyncio.sleep(WATCH_PERIOD_S)
        now = time.monotonic()
        try:
            check_instances(fe, now)
            if now - last_ping >= fe.opts.ping_interval_s:
                last_ping = now
                for h in fe.board.instances.values():
                    if h.identity is not None and h.state != "lost":
                        fe.send(h, m.Ping(now))
            for req in [r for r in fe.requests.values() if now > r.deadline]:
                logger.warning("request %s passed its deadline", req.request_id)
                fe.fail(req, RequestTimeoutError(f"the request did not finish within {fe.opts.request_timeout_s:.0f} s"))
        except Exception:
            logger.exception("the frontend watchdog failed")


def silence_allowed(fe: "ClusterEngine", h: InstanceHandle) -> float:
    """The heartbeat timeout, plus twice the instance's longest step: it beats between steps only."""
    return fe.opts.heartbeat_timeout_s + 2 * (h.ready.max_step_ms / 1000 if h.ready else 0.0)


def check_instances(fe: "ClusterEngine", now: float) -> None:
    for h in list(fe.board.instances.values()):
        if h.state == "lost":
            continue
        code = fe.launcher.exit_code(h.instance_id) if fe.launcher is not None else None
        if code is not None:
            lose(fe, h, f"process exited with code {code}")
        elif h.state != "starting" and now - h.last_heard > silence_allowed(fe, h):
            lose(fe, h, f"no heartbeat for {now - h.last_heard:.1f} s")
        elif h.state == "starting" and now > fe.ready_deadline:
            lose(fe, h, f"did not join within {fe.opts.ready_timeout_s:.0f} s")
    check_ready(fe)


def check_ready(fe: "ClusterEngine") -> None:
    """Once every launched instance joined (or was lost): build the controller, replay what waited."""
    if fe.ready.is_set() or any(fe.board[i].state == "starting" for i in fe.planned):
        return
    joined = [h for h in fe.board.instances.values() if h.ready is not None]
    if not joined:
        fe.dead_error = RuntimeError("no instance joined the cluster")
        fe.fail_all(EngineDeadError("no instance joined the cluster"))
        fe.ready.set()
        return
    fe.controller = fe.controller_factory(StepTimeTable(joined[0].ready.profile).seconds, fe.board.status_of)
    assign_roles(fe)
    fe.ready.set()
    apply_actions(fe, fe.controller.start())
    early, fe.early = fe.early, []
    for event in early:
        if not isinstance(event, ev.RequestArrived) or event.request_id in fe.requests:
            fe.post(event)
    for h in fe.board.instances.values():
        if h.state == "lost" and h.ready is not None:
            fe.post(ev.InstanceLost(h.instance_id))


def lose(fe: "ClusterEngine", h: InstanceHandle, reason: str) -> None:
    """Declare an instance lost: its streaming requests end with an error; the controller re-routes the rest."""
    logger.error("instance %d lost: %s", h.instance_id, reason)
    h.state, h.lost_reason = "lost", reason
    fe.counters["instance_deaths"] += 1
    if fe.launcher is not None:
        fe.launcher.kill(h.instance_id)
    for rid in list(h.requests):
        h.requests.discard(rid)
        req = fe.requests.get(rid)
        if req is None:
            continue
        if req.streamed or req.transfer is not None:
            fe.fail(req, InstanceLostError(f"the instance serving this request was lost ({reason})"))
        else:
            req.lost_from = h.instance_id  # the controller's re-route will count
    if h.ready is not None:
        fe.post(ev.InstanceLost(h.instance_id))
