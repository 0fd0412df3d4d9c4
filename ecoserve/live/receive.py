"""What the frontend does with each message from an instance: joins, statuses, outputs, failures, KV arrivals
(the other direction from `actions.py`)."""
from __future__ import annotations

import asyncio
import logging
import time

import zmq.asyncio

from ecoserve.cluster import events as ev
from ecoserve.live import messages as m
from ecoserve.live.actions import Dispatcher
from ecoserve.live.board import InstanceHandle
from ecoserve.live.errors import InstanceLostError
from ecoserve.live.shared import Frontend

logger = logging.getLogger(__name__)


class Receiver:
    """Reads the instances' socket; owns who is expected to join (launched pids) and whom it refused."""

    def __init__(self, fe: Frontend, dispatcher: Dispatcher, identity: str, planned: list[int],
                 launched: bool) -> None:
        self.fe = fe
        self.dispatcher = dispatcher
        self.identity = identity  # instances must report this model
        self.planned = planned
        self.launched = launched  # False: instances started by hand fill the planned slots
        self.pid_to_id: dict[int, int] = {}
        self.refused = 0  # instances refused at connect (version or model mismatch)
        self._handlers = {m.Status: self._status, m.Outputs: self._outputs, m.Paused: self._paused,
                          m.ImportedKV: self._imported, m.RequestFailed: self._failed,
                          m.Heartbeat: lambda h, msg, now: None}

    def expect(self, pid: int, instance_id: int) -> None:
        """A launched process: its `Ready` (naming this pid) takes that instance's slot."""
        self.pid_to_id[pid] = instance_id

    async def run(self, sock: zmq.asyncio.Socket) -> None:
        """Every message from every instance, in order per instance; a bad one is logged and dropped."""
        while True:
            try:
                frames = await sock.recv_multipart()
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
                self.handle_frame(frames[0], frames[1])
            except Exception:
                logger.exception("handling a message from an instance failed")

    def handle_frame(self, identity: bytes, frame: bytes) -> None:
        msg = m.decode_to_frontend(frame)
        if msg is None:
            return
        now = time.monotonic()
        if isinstance(msg, m.Ready):
            self._ready(identity, msg, now)
            return
        h = self.fe.board.by_identity(identity)
        if h is None:
            logger.warning("dropped %s from an instance that has not joined (or was lost)", type(msg).__name__)
            return
        h.last_heard = now
        handler = self._handlers.get(type(msg))
        if handler is not None:
            handler(h, msg, now)

    # ---- joins -------------------------------------------------------------------------------
    def _refuse(self, identity: bytes, why: str) -> None:
        logger.error("refused an instance: %s", why)
        self.refused += 1
        self.fe.send(InstanceHandle(-1, identity), m.Shutdown())

    def _ready(self, identity: bytes, msg: m.Ready, now: float) -> None:
        fe = self.fe
        if msg.version != m.PROTOCOL_VERSION:
            self._refuse(identity, f"protocol version {msg.version}, this frontend speaks {m.PROTOCOL_VERSION}")
            return
        if msg.model != self.identity:
            self._refuse(identity, f"it serves model {msg.model!r}, this cluster serves {self.identity!r}")
            return
        if fe.board.by_identity(identity) is not None:
            logger.warning("ignored a second ready from instance pid %d", msg.pid)
            return
        iid = self.pid_to_id.pop(msg.pid, None)
        if iid is None and not self.launched:
            iid = next((i for i in self.planned
                        if fe.board[i].state == "starting" and fe.board[i].identity is None), None)
        if iid is None:  # one more, started by hand (`ecoserve instance --connect`)
            iid = fe.board.add(InstanceHandle(fe.board.next_id())).instance_id
        h = fe.board[iid]
        if h.state != "starting":
            self._refuse(identity, f"instance {iid} is {h.state}")
            return
        h.identity, h.ready, h.pid, h.host, h.last_heard = identity, msg, msg.pid, msg.host, now
        h.state = "ready"
        fe.send(h, m.Welcome(iid))
        logger.info("instance %d joined: pid %d on %s, %d KV tokens%s", iid, msg.pid, msg.host, msg.total_kv_tokens,
                    " (mock)" if msg.mock else "")
        fe.post(ev.InstanceJoined(iid, msg.total_kv_tokens))
        fe.check_ready()

    # ---- news of requests ------------------------------------------------------------------
    def _status(self, h: InstanceHandle, msg: m.Status, now: float) -> None:
        if msg.status.instance_id != h.instance_id:
            logger.warning("dropped a status of instance %d from instance %d", msg.status.instance_id, h.instance_id)
            return
        if msg.seq <= h.status_seq:
            return  # out of date
        h.status_seq = msg.seq
        self.fe.board.reported(h, msg.status, msg.last_dispatch_seq, now)
        self.fe.post(ev.InstanceReported(h.instance_id))

    def _outputs(self, h: InstanceHandle, msg: m.Outputs, now: float) -> None:
        fe = self.fe
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

    def _paused(self, h: InstanceHandle, msg: m.Paused, now: float) -> None:
        if self.fe.requests.get(msg.request_id) is None:
            self.fe.send(h, m.Abort([msg.request_id]))  # nobody will claim its KV
            return
        self.fe.post(ev.PrefillDone(msg.request_id, h.instance_id, msg.num_tokens))

    def _imported(self, h: InstanceHandle, msg: m.ImportedKV, now: float) -> None:
        req = self.fe.requests.get(msg.request_id)
        if req is None or req.transfer != msg.transfer_id:
            self.fe.send(h, m.Abort([msg.request_id]))  # nobody will claim it
            return
        self.dispatcher.kv_arrived(req, h, msg.src, msg.nbytes)

    def _failed(self, h: InstanceHandle, msg: m.RequestFailed, now: float) -> None:
        req = self.fe.requests.get(msg.request_id)
        if req is None:
            return
        logger.error("instance %d failed request %s: %s", h.instance_id, msg.request_id, msg.reason)
        self.fe.fail(req, InstanceLostError(f"instance {h.instance_id} failed the request: {msg.reason}"))
