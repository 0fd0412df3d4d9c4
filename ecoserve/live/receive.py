"""What the frontend does with each message from an instance (kept apart from the action side)."""
from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from ecoserve.cluster import events as ev
from ecoserve.live import messages as m
from ecoserve.live.actions import kv_arrived
from ecoserve.live.board import InstanceHandle
from ecoserve.live.errors import InstanceLostError

if TYPE_CHECKING:
    from ecoserve.live.frontend import ClusterEngine

logger = logging.getLogger(__name__)


def handle_frame(fe: "ClusterEngine", identity: bytes, frame: bytes) -> None:
    msg = m.decode_to_frontend(frame)
    if msg is None:
        return
    now = time.monotonic()
    if isinstance(msg, m.Ready):
        _ready(fe, identity, msg, now)
        return
    h = fe.board.by_identity(identity)
    if h is None:
        logger.warning("dropped %s from an instance that has not joined (or was lost)", type(msg).__name__)
        return
    h.last_heard = now
    handler = _HANDLERS.get(type(msg))
    if handler is not None:
        handler(fe, h, msg, now)


def _refuse(fe: "ClusterEngine", identity: bytes, why: str) -> None:
    logger.error("refused an instance: %s", why)
    fe.counters["refused_instances"] += 1
    fe.send(InstanceHandle(-1, identity), m.Shutdown())


def _ready(fe: "ClusterEngine", identity: bytes, msg: m.Ready, now: float) -> None:
    if msg.version != m.PROTOCOL_VERSION:
        _refuse(fe, identity, f"protocol version {msg.version}, this frontend speaks {m.PROTOCOL_VERSION}")
        return
    if msg.model != fe.identity:
        _refuse(fe, identity, f"it serves model {msg.model!r}, this cluster serves {fe.identity!r}")
        return
    if fe.board.by_identity(identity) is not None:
        logger.warning("ignored a second ready from instance pid %d", msg.pid)
        return
    iid = fe.pid_to_id.pop(msg.pid, None)
    if iid is None and fe.launcher is None:  # no launcher: instances started by hand fill the planned slots
        iid = next((i for i in fe.planned if fe.board[i].state == "starting" and fe.board[i].identity is None), None)
    if iid is None:  # one more, started by hand (`ecoserve instance --connect`)
        iid = fe.board.add(InstanceHandle(fe.board.next_id())).instance_id
    h = fe.board[iid]
    if h.state != "starting":
        _refuse(fe, identity, f"instance {iid} is {h.state}")
        return
    h.identity, h.ready, h.pid, h.host, h.last_heard = identity, msg, msg.pid, msg.host, now
    h.state = "ready"
    fe.send(h, m.Welcome(iid))
    logger.info("instance %d joined: pid %d on %s, %d KV tokens%s", iid, msg.pid, msg.host, msg.total_kv_tokens,
                " (mock)" if msg.mock else "")
    fe.post(ev.InstanceJoined(iid, msg.total_kv_tokens))
    from ecoserve.live.watch import check_ready  # the watchdog reads this module's messages
    check_ready(fe)


def _status(fe: "ClusterEngine", h: InstanceHandle, msg: m.Status, now: float) -> None:
    if msg.status.instance_id != h.instance_id:
        logger.warning("dropped a status of instance %d from instance %d", msg.status.instance_id, h.instance_id)
        return
    if msg.seq <= h.status_seq:
        return  # out of date
    h.status_seq = msg.seq
    fe.board.reported(h, msg.status, msg.last_dispatch_seq, now)
    fe.post(ev.InstanceReported(h.instance_id))


def _outputs(fe: "ClusterEngine", h: InstanceHandle, msg: m.Outputs, now: float) -> None:
    touched = {}
    for d in msg.deltas:
        req = fe.requests.get(d.request_id)
        if req is None or req.instance != h.instance_id:
            continue  # aborted meanwhile, or a late delta from where it no longer runs
        if d.token_ids and req.first_token is None:
            fe.board.first_token_at[req.request_id] = now
        req.apply(d, now)
        touched[req.request_id] = req
    for req in touched.values():
        if req.all_finished:
            h.requests.discard(req.request_id)
            req.finished = now
            req.done = True
            fe.deliver(req)
            fe.end(req)
            ttft = req.first_token - req.arrival if req.first_token is not None else None
            fe.post(ev.RequestFinished(req.request_id, h.instance_id, ttft))
        else:
            fe.deliver(req)


def _paused(fe: "ClusterEngine", h: InstanceHandle, msg: m.Paused, now: float) -> None:
    req = fe.requests.get(msg.request_id)
    if req is None:
        fe.send(h, m.Abort([msg.request_id]))  # nobody will claim its KV
        return
    fe.post(ev.PrefillDone(msg.request_id, h.instance_id, msg.num_tokens))


def _imported(fe: "ClusterEngine", h: InstanceHandle, msg: m.ImportedKV, now: float) -> None:
    req = fe.requests.get(msg.request_id)
    if req is None or req.transfer != msg.transfer_id:
        fe.send(h, m.Abort([msg.request_id]))  # nobody will claim it
        return
    kv_arrived(fe, req, h, msg.src, msg.nbytes)


def _failed(fe: "ClusterEngine", h: InstanceHandle, msg: m.RequestFailed, now: float) -> None:
    req = fe.requests.get(msg.request_id)
    if req is None:
        return
    logger.error("instance %d failed request %s: %s", h.instance_id, msg.request_id, msg.reason)
    fe.fail(req, InstanceLostError(f"instance {h.instance_id} failed the request: {msg.reason}"))


_HANDLERS = {m.Status: _status, m.Outputs: _outputs, m.Paused: _paused, m.ImportedKV: _imported,
             m.RequestFailed: _failed, m.Heartbeat: lambda fe, h, msg, now: None}
