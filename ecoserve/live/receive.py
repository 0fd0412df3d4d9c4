"""What the frontend does with each message from an instance: joins, statuses, outputs, failures, KV arrivals
(the other direction from `actions.py`).

Who says what is checked: news of a request is taken only from the instance that runs it (a KV
arrival only from the destination that was asked); anything else is dropped and counted. A joining
instance's KV layout must be the cluster's, and joins by hand are rate-limited.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import time
from dataclasses import dataclass

import zmq.asyncio

from ecoserve.cluster import events as ev
from ecoserve.live import messages as m
from ecoserve.live.actions import Dispatcher
from ecoserve.live.board import InstanceHandle
from ecoserve.live.errors import InstanceLostError
from ecoserve.live.shared import Frontend

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class KVLayout:
    """What must agree between instances before KV moves between them."""

    block_size: int
    kv_dtype: str
    kv_bytes_per_token: int

    @classmethod
    def of(cls, ready: m.Ready) -> KVLayout:
        return cls(ready.block_size, ready.kv_dtype, ready.kv_bytes_per_token)


class JoinLimiter:
    """At most `max_joins` joins by hand per `interval_s`; refusals beyond that are logged once per interval."""

    def __init__(self, max_joins: int = 8, interval_s: float = 10.0) -> None:
        self.max_joins, self.interval_s = max_joins, interval_s
        self._recent: collections.deque[float] = collections.deque()
        self._logged_at = float("-inf")
        self.refused_since_log = 0

    def allow(self, now: float) -> bool:
        while self._recent and now - self._recent[0] > self.interval_s:
            self._recent.popleft()
        if len(self._recent) < self.max_joins:
            self._recent.append(now)
            return True
        self.refused_since_log += 1
        if now - self._logged_at >= self.interval_s:
            logger.error("refused %d instance join(s) by hand: more than %d in %.0f s", self.refused_since_log,
                         self.max_joins, self.interval_s)
            self._logged_at, self.refused_since_log = now, 0
        return False


class Receiver:
    """Reads the instances' socket; owns who is expected to join (launched pids), whom it refused, the
    cluster's KV layout and the messages it rejected for a wrong sender."""

    def __init__(self, fe: Frontend, dispatcher: Dispatcher, identity: str, planned: list[int],
                 launched: bool) -> None:
        self.fe = fe
        self.dispatcher = dispatcher
        self.identity = identity  # instances must report this model
        self.planned = planned
        self.launched = launched  # False: instances started by hand fill the planned slots
        self.pid_to_id: dict[int, int] = {}
        self.refused = 0  # instances refused at connect (version, model or KV layout mismatch, too many joins)
        self.rejected = 0  # messages dropped for a wrong sender (news of a request another instance runs)
        self.layout: KVLayout | None = None  # fixed by the first instance that joins
        self.joins = JoinLimiter()
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
    def _refuse(self, identity: bytes, why: str | None) -> None:
        """`why` None: already logged (a flood of joins is logged once per interval)."""
        if why is not None:
            logger.error("refused an instance: %s", why)
        self.refused += 1
        self.fe.send(InstanceHandle(-1, identity), m.Shutdown())

    def _reject(self, h: InstanceHandle, msg: m.Msg, request_id: str) -> None:
        self.rejected += 1
        logger.warning("dropped %s about request %s from instance %d, which does not run it", type(msg).__name__,
                       request_id, h.instance_id)

    def _ready(self, identity: bytes, msg: m.Ready, now: float) -> None:
        fe = self.fe
        if msg.version != m.PROTOCOL_VERSION:
            self._refuse(identity, f"protocol version {msg.version}, this frontend speaks {m.PROTOCOL_VERSION}")
            return
        if msg.model != self.identity:
            self._refuse(identity, f"it serves model {msg.model!r}, this cluster serves {self.identity!r}")
            return
        layout = KVLayout.of(msg)
        if self.layout is not None and layout != self.layout:
            self._refuse(identity, f"its KV layout {layout} is not the cluster's {self.layout}")
            return
        if fe.board.by_identity(identity) is not None:
            logger.warning("ignored a second ready from instance pid %d", msg.pid)
            return
        iid = self.pid_to_id.pop(msg.pid, None)
        if iid is None and not self.launched:
            iid = next((i for i in self.planned
                        if fe.board[i].state == "starting" and fe.board[i].identity is None), None)
        if iid is None:  # one more, started by hand (`ecoserve instance --connect`)
            if not self.joins.allow(now):
                self._refuse(identity, None)
                return
            iid = fe.board.add(InstanceHandle(fe.board.next_id())).instance_id
        h = fe.board[iid]
        if h.state != "starting":
            self._refuse(identity, f"instance {iid} is {h.state}")
            return
        h.identity, h.ready, h.pid, h.host, h.last_heard = identity, msg, msg.pid, msg.host, now
        h.state = "ready"
        self.layout = self.layout or layout
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
            if req is None:
                continue  # aborted meanwhile
            if req.instance != h.instance_id:  # it runs elsewhere (or it was never here)
                self._reject(h, msg, d.request_id)
                continue
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
                ttft = req.first_delivery - req.arrival if req.first_delivery is not None else None
                fe.post(ev.RequestFinished(req.request_id, h.instance_id, ttft))
            else:
                fe.deliver(req)

    def _paused(self, h: InstanceHandle, msg: m.Paused, now: float) -> None:
        req = self.fe.requests.get(msg.request_id)
        if req is None:
            self.fe.send(h, m.Abort([msg.request_id]))  # nobody will claim its KV
            return
        if req.instance != h.instance_id:
            self._reject(h, msg, msg.request_id)
            return
        self.fe.post(ev.PrefillDone(msg.request_id, h.instance_id, msg.num_tokens))

    def _imported(self, h: InstanceHandle, msg: m.ImportedKV, now: float) -> None:
        req = self.fe.requests.get(msg.request_id)
        if req is None or req.transfer != msg.transfer_id:
            self.fe.send(h, m.Abort([msg.request_id]))  # nobody will claim it
            return
        # only the destination that was asked: it holds the request, and it is not the KV's source
        if msg.request_id not in h.requests or h.instance_id == req.kv_src or msg.src != req.kv_src:
            self._reject(h, msg, msg.request_id)
            return
        self.dispatcher.kv_arrived(req, h, msg.src, msg.nbytes)

    def _failed(self, h: InstanceHandle, msg: m.RequestFailed, now: float) -> None:
        req = self.fe.requests.get(msg.request_id)
        if req is None:
            return
        if msg.request_id not in h.requests:  # it runs the request, or its KV moves through it
            self._reject(h, msg, msg.request_id)
            return
        if msg.refused:  # bad input the frontend could not see (a LoRA adapter the engine refuses): a 400
            logger.warning("instance %d refused request %s: %s", h.instance_id, msg.request_id, msg.reason)
            self.fe.fail(req, ValueError(msg.reason))
            return
        logger.error("instance %d failed request %s: %s", h.instance_id, msg.request_id, msg.reason)
        self.fe.fail(req, InstanceLostError(f"instance {h.instance_id} failed the request: {msg.reason}"))
