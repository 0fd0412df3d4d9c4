"""The instance process: one engine in its own loop, talking to the frontend over one ZeroMQ connection.

The loop applies the frontend's commands between steps, steps the engine, sends each step's output
deltas in one message, a status after every step (and at least every `status_interval_s`), and a
heartbeat from the same loop, so an engine that stalls goes silent and is declared lost. The
connection itself is watched by libzmq (ZMTP heartbeats, answered by its I/O thread even during a
long step) and by a socket monitor here: the instance exits (3) only when the frontend has been
disconnected for longer than `reconnect_window_s`, and with ENGINE_DEAD when its engine fails (e.g. a
rank of a parallel instance died or stalled: the engine's error names it), which the frontend sees as
a lost instance. KV exports run on their own thread (`KVSender`); imports are accepted only when the
frontend announced them (`ExpectKV`) and every frame has the layout's size.
"""
from __future__ import annotations

import logging
import os
import socket
import time
import uuid
from dataclasses import dataclass

import zmq
from zmq.utils.monitor import recv_monitor_message

from ecoserve.cluster.status import instance_status
from ecoserve.live import messages as m
from ecoserve.live.auth import ClusterAuth, make_client, start_authenticator
from ecoserve.live.engines import RequestRefusedError
from ecoserve.live.kv import KVExpectation, KVHeader, KVSender, ZmqKVConnector, check_transfer

logger = logging.getLogger(__name__)
ENGINE_DEAD = 4  # exit status of an instance whose engine failed
FRONTEND_GONE = 3  # exit status of an instance whose frontend stayed disconnected past the window

_HANDSHAKE_FAILED = {zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "the handshake failed (no detail: another key set?)",
                     zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "the handshake failed (a protocol or mechanism mismatch)",
                     zmq.EVENT_HANDSHAKE_FAILED_AUTH: "the frontend refused this instance's key"}
_LINK_EVENTS = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED
for _event in _HANDSHAKE_FAILED:
    _LINK_EVENTS |= _event


@dataclass(frozen=True)
class InstanceOptions:
    connect: str  # the frontend's address, tcp://HOST:PORT
    host: str = "127.0.0.1"  # where this instance's KV receiver listens
    heartbeat_s: float = 0.5
    status_interval_s: float = 0.25
    reconnect_window_s: float = 10.0  # exit when the frontend has been disconnected this long
    welcome_timeout_s: float = 30.0
    kv_send_timeout_s: float = 5.0
    auth: ClusterAuth | None = None  # None: no CURVE (`--cluster-auth none`)
    zmtp_heartbeat_s: float = 1.0  # libzmq's connection heartbeat (its I/O thread answers it)
    zmtp_heartbeat_timeout_s: float = 3.0


class FrontendLink:
    """The state of the connection to the frontend, from the DEALER's socket monitor."""

    def __init__(self, sock: zmq.Socket) -> None:
        self.monitor = sock.get_monitor_socket(_LINK_EVENTS)
        self.connected = False
        self.down_since: float | None = time.monotonic()
        self.failed_event: int | None = None  # how the last handshake failed
        self.failed_handshakes = 0  # since the last one that succeeded

    def update(self) -> None:
        while True:
            try:
                event = recv_monitor_message(self.monitor, zmq.NOBLOCK)["event"]
            except zmq.Again:
                return
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.connected, self.down_since, self.failed_event, self.failed_handshakes = True, None, None, 0
            elif event == zmq.EVENT_DISCONNECTED:
                if self.down_since is None:
                    self.down_since = time.monotonic()
                self.connected = False
            elif event in _HANDSHAKE_FAILED:
                self.failed_event = event
                self.failed_handshakes += 1

    def refused_why(self) -> str | None:
        """Why the frontend will not take this instance (a key or `--cluster-auth` mismatch), if it is clear."""
        e = self.failed_event
        if e is None or (e == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL and self.failed_handshakes < 2):
            return None  # a single undetailed failure may be a connection cut mid-handshake
        return _HANDSHAKE_FAILED[e]

    def joined(self) -> None:
        """A welcome came through: the link is up, whatever the monitor has not reported yet."""
        self.update()
        self.connected, self.down_since = True, None

    def down_for(self, now: float) -> float:
        return 0.0 if self.down_since is None else now - self.down_since

    def close(self) -> None:
        self.monitor.close(0)


class InstanceLoop:
    def __init__(self, engine, options: InstanceOptions, profile: list[tuple[int, float]]) -> None:
        self.engine, self.opts, self.profile = engine, options, profile
        self.instance_id = -1
        self.ctx = zmq.Context()
        auth = options.auth
        # the KV receiver is a CURVE server: its handshakes need an authenticator in this context
        self.authenticator = start_authenticator(self.ctx, auth) if auth is not None else None
        self.sock = self.ctx.socket(zmq.DEALER)
        self._configure(self.sock)
        self.link = FrontendLink(self.sock)
        kv = engine.scheduler.kv
        max_frame = max(engine.kv_frame_sizes(kv.blocks_needed(engine.max_model_len)), default=0)
        self.kv = ZmqKVConnector(self.ctx, options.host, auth, max_frame)
        self.sender = KVSender(self.ctx, auth)
        self._pinned: dict[str, int] = {}  # request id -> tokens so far (for the KV it will hold)
        self._exporting: dict[str, int] = {}  # request id -> transfer id of an export on the sender thread
        self._expected: dict[str, KVExpectation] = {}  # imports the frontend announced
        self._last_dispatch = 0
        self._status_seq = 0
        self._stop = False

    def _configure(self, sock: zmq.Socket) -> None:
        o = self.opts
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 0)  # never drop or refuse a message to a busy frontend: queue it
        sock.setsockopt(zmq.RCVHWM, 0)
        # one identity for the whole run: a reconnection after a network blip is the same instance
        sock.setsockopt(zmq.ROUTING_ID, b"ecoserve-" + uuid.uuid4().hex.encode())
        sock.setsockopt(zmq.HEARTBEAT_IVL, int(o.zmtp_heartbeat_s * 1000))
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(o.zmtp_heartbeat_timeout_s * 1000))
        sock.setsockopt(zmq.HEARTBEAT_TTL, int(o.zmtp_heartbeat_timeout_s * 1000))
        sock.setsockopt(zmq.RECONNECT_IVL, 100)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
        if o.auth is not None:
            make_client(sock, o.auth)

    def send(self, msg: m.Msg) -> None:
        self.sock.send(m.encode(msg), copy=False)

    # ---- start -----------------------------------------------------------------------------
    def _hello(self) -> bool:
        e = self.engine
        sched = e.scheduler
        self.sock.connect(self.opts.connect)
        self.send(m.Ready(m.PROTOCOL_VERSION, e.model_name, os.getpid(), socket.gethostname(), self.kv.address,
                          sched.kv.num_blocks * sched.kv.block_size, sched.kv.block_size, e.kv_bytes_per_token,
                          e.max_model_len, self.profile, e.mock, self._max_step_ms(),
                          m.EngineSettings(sched.config.policy, sched.config.max_num_batched_tokens,
                                           sched.config.max_num_seqs, e.quantization), e.kv_dtype))
        deadline = time.monotonic() + self.opts.welcome_timeout_s
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self.link.monitor, zmq.POLLIN)
        while time.monotonic() < deadline:
            ready = dict(poller.poll(100))
            if self.link.monitor in ready:
                self.link.update()
                why = self.link.refused_why()
                if why is not None:
                    logger.error("cannot join the frontend at %s: %s; --cluster-auth and --cluster-key-dir must "
                                 "match the frontend's", self.opts.connect, why)
                    return False
            if self.sock not in ready:
                continue
            msg = m.decode_to_instance(self.sock.recv())
            if isinstance(msg, m.Welcome):
                self.instance_id = msg.instance_id
                self.link.joined()
                return True
            if isinstance(msg, m.Shutdown):
                logger.error("the frontend refused this instance (its log says why)")
                return False
        logger.error("no welcome from the frontend at %s within %.0f s", self.opts.connect,
                     self.opts.welcome_timeout_s)
        return False

    def _max_step_ms(self) -> float:
        from ecoserve.cluster.profile import StepTimeTable

        budget = self.engine.scheduler.config.max_num_batched_tokens
        return StepTimeTable(self.profile).ms(budget) if self.profile else 0.0

    def run(self) -> int:
        """Serve until told to shut down (0), the frontend is gone (3) or the engine failed (ENGINE_DEAD);
        the engine is closed on the way out."""
        try:
            if not self._hello():
                return 1
            return self._loop()
        finally:
            try:  # first: the connection stays up until little is left before this process exits
                self.engine.close()
            except Exception:
                logger.exception("closing the engine failed")
            self.sender.close(self.opts.kv_send_timeout_s + 1.0)
            self.kv.close()
            self.link.close()
            self.sock.close(0)
            if self.authenticator is not None:
                self.authenticator.stop()
            self.ctx.destroy(0)

    # ---- the loop --------------------------------------------------------------------------
    def _loop(self) -> int:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self.kv.pull, zmq.POLLIN)
        poller.register(self.link.monitor, zmq.POLLIN)
        last_beat = last_status = time.monotonic()
        status_dirty = True
        while True:
            busy = self.engine.has_work()
            ready = dict(poller.poll(20 if not busy else 2 if self.engine.stuck else 0))
            if self.sock in ready:
                status_dirty |= self._drain_commands()
            if self.link.monitor in ready:
                self.link.update()
            down = self.link.down_for(time.monotonic())
            if down > self.opts.reconnect_window_s:
                logger.error("the frontend has been disconnected for %.1f s (%s): exiting", down,
                             self.link.refused_why() or "no reconnection")
                return FRONTEND_GONE
            if self.kv.pull in ready:
                status_dirty |= self._imports()
            if self._stop:
                return 0
            status_dirty |= self._exports_done()
            if busy:
                try:
                    deltas = self.engine.step()
                except Exception:
                    logger.exception("the engine failed: this instance stops (the frontend declares it lost)")
                    return ENGINE_DEAD
                if deltas:
                    self.send(m.Outputs(deltas))
                    self._check_paused(deltas)
                for request_id, reason in self.engine.take_failed().items():  # each failed alone; we go on
                    self._pinned.pop(request_id, None)
                    self.send(m.RequestFailed(request_id, reason))
                status_dirty = True
            now = time.monotonic()
            if status_dirty or now - last_status >= self.opts.status_interval_s:
                self._send_status()
                last_status, status_dirty = now, False
            if now - last_beat >= self.opts.heartbeat_s:
                try:
                    self.engine.check()  # a parallel instance's ranks, also while idle
                except Exception:
                    logger.exception("the engine failed: this instance stops (the frontend declares it lost)")
                    return ENGINE_DEAD
                self.send(m.Heartbeat(now))
                last_beat = now

    def _send_status(self) -> None:
        self._status_seq += 1
        st = instance_status(self.instance_id, self.engine.scheduler, self.engine.resident_loras())
        self.send(m.Status(self._status_seq, self._last_dispatch, st))

    def _drain_commands(self) -> bool:
        changed = False
        while True:
            try:
                frame = self.sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return changed
            msg = m.decode_to_instance(frame)
            if msg is None or isinstance(msg, m.Ping):
                continue
            changed = True
            try:
                self._apply(msg)
            except Exception:  # one bad command must not take the instance down
                logger.exception("command %s failed", type(msg).__name__)

    def _apply(self, msg: m.Msg) -> None:
        sched = self.engine.scheduler
        if isinstance(msg, m.AddRequest):
            self._last_dispatch = max(self._last_dispatch, msg.dispatch_seq)
            try:
                self.engine.add(msg)
            except ValueError as e:
                logger.warning("refused request %s: %s", msg.request_id, e)
                self.send(m.RequestFailed(msg.request_id, str(e), refused=isinstance(e, RequestRefusedError)))
                return
            if msg.pin_kv:
                self._pinned[msg.request_id] = len(msg.prompt_token_ids)
        elif isinstance(msg, m.Abort):
            self.engine.abort(msg.request_ids)
            for rid in msg.request_ids:
                sched.kv.release(rid)  # an export or import that will not be claimed
                self._pinned.pop(rid, None)
                self._expected.pop(rid, None)
                self._exporting.pop(rid, None)  # its frames are a copy: the sender may finish or fail alone
        elif isinstance(msg, m.SetWindow):
            sched.open_window() if msg.open else sched.close_window()
        elif isinstance(msg, m.ExportKV):
            self._export(msg)
        elif isinstance(msg, m.ExpectKV):
            self._expected[msg.request_id] = KVExpectation(msg.request_id, msg.transfer_id, msg.num_tokens, msg.src)
        elif isinstance(msg, m.Shutdown):
            self._stop = True
        elif isinstance(msg, m.Welcome):
            logger.warning("ignored a second welcome")

    def _check_paused(self, deltas: list[m.Delta]) -> None:
        for d in deltas:
            if d.request_id not in self._pinned:
                continue
            self._pinned[d.request_id] += len(d.token_ids)
            if d.finish_reason is None:
                continue
            tokens = self._pinned.pop(d.request_id) - 1  # the last sampled token has no KV yet
            if self.engine.scheduler.kv.held_block_ids(d.request_id) is not None:
                self.send(m.Paused(d.request_id, tokens))

    # ---- KV --------------------------------------------------------------------------------
    def _export(self, msg: m.ExportKV) -> None:
        """Hand the pinned blocks' frames to the sender thread; they stay pinned until it reports."""
        kv = self.engine.scheduler.kv
        rid = msg.request_id
        ids = kv.held_block_ids(rid)
        if ids is None or rid in self._exporting:
            self.send(m.RequestFailed(rid, "no pinned KV to export here"))
            return
        try:
            buffers = self.engine.read_blocks(ids)
        except NotImplementedError as e:
            kv.release(rid)
            self.send(m.RequestFailed(rid, str(e)))
            return
        nbytes = sum(b.nbytes for b in buffers)
        self._exporting[rid] = msg.transfer_id
        self.sender.submit(msg.dst_address, KVHeader(rid, msg.transfer_id, self.instance_id, msg.num_tokens, nbytes),
                           buffers, self.opts.kv_send_timeout_s)

    def _exports_done(self) -> bool:
        """Release the blocks of the exports the sender thread finished; a failed one fails its request."""
        changed = False
        for o in self.sender.outcomes():
            if self._exporting.get(o.request_id) != o.transfer_id:
                continue  # aborted meanwhile: its blocks are already free
            del self._exporting[o.request_id]
            self.engine.scheduler.kv.release(o.request_id)
            changed = True
            if o.error is not None:
                logger.error("%s", o.error)
                self.send(m.RequestFailed(o.request_id, o.error))
        return changed

    def _imports(self) -> bool:
        """Accept each announced, well-formed transfer into fresh blocks; refuse (and log) the rest."""
        kv = self.engine.scheduler.kv
        got = self.kv.receive()
        for header, buffers in got:
            rid = header.request_id
            if rid not in self._expected:
                self._drain_commands()  # its ExpectKV may have arrived with it
            expected = self._expected.get(rid)
            sizes = self.engine.kv_frame_sizes(kv.blocks_needed(expected.num_tokens)) if expected else []
            why = check_transfer(header, buffers, expected, sizes)
            if why is not None:
                logger.warning("refused a KV transfer (request %r from instance %d): %s", rid, header.src, why)
                if expected is not None:
                    del self._expected[rid]
                    self.send(m.RequestFailed(rid, f"the KV transfer was refused: {why}"))
                continue
            del self._expected[rid]
            ids = kv.import_blocks(rid, header.num_tokens)
            if ids is None:
                self.send(m.RequestFailed(rid, f"no room for {header.num_tokens} tokens of imported KV"))
                continue
            try:
                self.engine.write_blocks(ids, buffers)
            except Exception as e:  # never report blocks that were not written as imported
                logger.exception("writing the imported KV of %s failed", rid)
                kv.release(rid)
                self.send(m.RequestFailed(rid, f"writing the imported KV failed: {e}"))
                continue
            self.send(m.ImportedKV(rid, header.transfer_id, header.src, header.nbytes))
        return bool(got)
