"""The instance process: one engine in its own loop, talking to the frontend over one ZeroMQ connection.

The loop applies the frontend's commands between steps, steps the engine, sends each step's output
deltas in one message, a status after every step (and at least every `status_interval_s`), and a
heartbeat from the same loop, so an engine that stalls goes silent and is declared lost. It exits on
its own when the frontend has been silent for `frontend_timeout_s` (the frontend died), and with
ENGINE_DEAD when its engine fails (e.g. a rank of a parallel instance died or stalled: the engine's
error names it), which the frontend sees as a lost instance.
"""
from __future__ import annotations

import logging
import os
import socket
import time
from dataclasses import dataclass

import zmq

from ecoserve.cluster.status import instance_status
from ecoserve.live import messages as m
from ecoserve.live.kv import KVHeader, ZmqKVConnector

logger = logging.getLogger(__name__)
ENGINE_DEAD = 4  # exit status of an instance whose engine failed


@dataclass(frozen=True)
class InstanceOptions:
    connect: str  # the frontend's address, tcp://HOST:PORT
    host: str = "127.0.0.1"  # where this instance's KV receiver listens
    heartbeat_s: float = 0.5
    status_interval_s: float = 0.25
    frontend_timeout_s: float = 5.0
    welcome_timeout_s: float = 30.0
    kv_send_timeout_s: float = 5.0


class InstanceLoop:
    def __init__(self, engine, options: InstanceOptions, profile: list[tuple[int, float]]) -> None:
        self.engine, self.opts, self.profile = engine, options, profile
        self.instance_id = -1
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.kv = ZmqKVConnector(self.ctx, options.host)
        self._pinned: dict[str, int] = {}  # request id -> tokens so far (for the KV it will hold)
        self._last_dispatch = 0
        self._status_seq = 0
        self._stop = False

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
                                           sched.config.max_num_seqs, e.quantization)))
        deadline = time.monotonic() + self.opts.welcome_timeout_s
        while time.monotonic() < deadline:
            if not self.sock.poll(100):
                continue
            msg = m.decode_to_instance(self.sock.recv())
            if isinstance(msg, m.Welcome):
                self.instance_id = msg.instance_id
                return True
            if isinstance(msg, m.Shutdown):
                logger.error("the frontend refused this instance")
                return False
        logger.error("no welcome from the frontend at %s within %.0f s", self.opts.connect,
                     self.opts.welcome_timeout_s)
        return False

    def _max_step_ms(self) -> float:
        from ecoserve.cluster.profile import StepTimeTable

        budget = self.engine.scheduler.config.max_num_batched_tokens
        return StepTimeTable(self.profile).ms(budget) if self.profile else 0.0

    def run(self) -> int:
        """Serve until told to shut down (0), the frontend is gone (3) or the engine failed (ENGINE_DEAD)."""
        try:
            if not self._hello():
                return 1
            return self._loop()
        finally:
            self.kv.close()
            self.sock.close(0)
            self.ctx.term()

    # ---- the loop --------------------------------------------------------------------------
    def _loop(self) -> int:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self.kv.pull, zmq.POLLIN)
        last_heard = last_beat = last_status = time.monotonic()
        status_dirty = True
        while True:
            busy = self.engine.has_work()
            ready = dict(poller.poll(20 if not busy else 2 if self.engine.stuck else 0))
            if self.sock in ready:
                status_dirty |= self._drain_commands()
                last_heard = time.monotonic()
                if self._stop:
                    return 0
            elif time.monotonic() - last_heard > self.opts.frontend_timeout_s:
                # checked only after a poll: pings queued during a long step are read before this
                logger.error("the frontend has been silent for %.1f s: exiting", time.monotonic() - last_heard)
                return 3
            if self.kv.pull in ready:
                status_dirty |= self._imports()
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
        st = instance_status(self.instance_id, self.engine.scheduler)
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
                self.send(m.RequestFailed(msg.request_id, str(e)))
                return
            if msg.pin_kv:
                self._pinned[msg.request_id] = len(msg.prompt_token_ids)
        elif isinstance(msg, m.Abort):
            self.engine.abort(msg.request_ids)
            for rid in msg.request_ids:
                sched.kv.release(rid)  # an export or import that will not be claimed
                self._pinned.pop(rid, None)
        elif isinstance(msg, m.SetWindow):
            sched.open_window() if msg.open else sched.close_window()
        elif isinstance(msg, m.ExportKV):
            self._export(msg)
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
        kv = self.engine.scheduler.kv
        ids = kv.held_block_ids(msg.request_id)
        if ids is None:
            self.send(m.RequestFailed(msg.request_id, "no pinned KV to export here"))
            return
        try:
            buffers = self.engine.read_blocks(ids)
            nbytes = sum(b.nbytes for b in buffers)
            tokens = msg.num_tokens
            self.kv.send(msg.dst_address, KVHeader(msg.request_id, msg.transfer_id, self.instance_id, tokens,
                                                   nbytes), buffers, self.opts.kv_send_timeout_s)
        except (TimeoutError, NotImplementedError) as e:
            self.send(m.RequestFailed(msg.request_id, str(e)))
        finally:
            kv.release(msg.request_id)

    def _imports(self) -> bool:
        kv = self.engine.scheduler.kv
        got = self.kv.receive()
        for header, buffers in got:
            ids = kv.import_blocks(header.request_id, header.num_tokens)
            if ids is None:
                self.send(m.RequestFailed(header.request_id, f"no room for {header.num_tokens} tokens of "
                                                             f"imported KV"))
                continue
            try:
                self.engine.write_blocks(ids, buffers)
            except NotImplementedError as e:
                kv.release(header.request_id)
                self.send(m.RequestFailed(header.request_id, str(e)))
                continue
            self.send(m.ImportedKV(header.request_id, header.transfer_id, header.src, header.nbytes))
        return bool(got)
