"""The controller's actions carried out on real instances: dispatch, KV transfer, windows, output hold,
finish, timers (the other direction from `receive.py`).

A dispatch becomes an `AddRequest` on the instance's connection; a decode dispatch whose KV is still
on the prefill side first asks that instance to export it to the destination's KV receiver; every
transfer has a deadline. A request with output so far (FuDG's decode leg, a migrated stream) goes as
prompt + that output, with what is left of its budget, and the text the client has.
"""
from __future__ import annotations

import itertools
from collections import deque
import logging
import time
from typing import Any, Callable

from ecoserve.cluster import events as ev
from ecoserve.live import messages as m
from ecoserve.live.board import InstanceHandle
from ecoserve.live.errors import InstanceLostError
from ecoserve.live.requests import LiveRequest
from ecoserve.live.shared import Frontend

logger = logging.getLogger(__name__)
RECENT_MIGRATIONS = 256


class Dispatcher:
    """Carries out actions; owns the KV transfers in flight (their ids and deadlines) and what moved."""

    def __init__(self, fe: Frontend, max_model_len: int, kv_transfer_timeout_s: float) -> None:
        self.fe = fe
        self.max_model_len = max_model_len
        self.kv_transfer_timeout_s = kv_transfer_timeout_s
        self.transfer_ids = itertools.count(1)
        self.reroutes = 0  # requests dispatched again after their instance was lost, before their first token
        self.migrations = 0  # started requests dispatched again (as prompt + output) after their instance was lost
        self.kv_bytes_moved = 0
        self.mitosis_events = 0  # Scale actions applied (timed or by hand)
        # the latest migrations, {request_id, from, to}, for /cluster (which streams moved, and where)
        self.recent_migrations: deque[dict] = deque(maxlen=RECENT_MIGRATIONS)
        self._handlers: dict[type, Callable[[Any], None]] = {
            ev.Dispatch: self.dispatch, ev.TransferKV: self.transfer, ev.OpenWindow: self.window,
            ev.CloseWindow: self.window, ev.HoldOutput: self.hold, ev.ReleaseOutput: self.hold, ev.Scale: self.scale,
            ev.FinishRequest: self.finish, ev.SetTimer: self.timer}

    def apply(self, actions: list[ev.Action]) -> None:
        for a in actions:
            handler = self._handlers.get(type(a))
            if handler is None:
                logger.error("unknown controller action %r", a)
                continue
            handler(a)

    # ---- requests --------------------------------------------------------------------------
    def dispatch(self, a: ev.Dispatch) -> None:
        fe = self.fe
        req = fe.requests.get(a.request_id)
        h = fe.board.instances.get(a.instance_id)
        if req is None:
            return
        if h is None or h.state in ("lost", "starting") or h.identity is None:
            fe.fail(req, InstanceLostError(f"the controller sent the request to unusable instance {a.instance_id}"))
            return
        if req.streamed and not a.imported_tokens and req.lost_from is None:
            fe.fail(req, InstanceLostError("the request had streamed tokens and cannot move to another instance"))
            return
        self._report_route(req, h, a)
        if req.lost_from is not None:
            lost_from, req.lost_from = req.lost_from, None
            if req.streamed:
                self.migrations += 1
                self.recent_migrations.append({"request_id": req.request_id, "from": lost_from, "to": h.instance_id})
            else:
                req.reroutes += 1
                self.reroutes += 1
        if req.first_scheduled is None:
            req.first_scheduled = time.monotonic()
        if a.imported_tokens and req.kv_dst != a.instance_id:  # the KV is still on the prefill side: fetch it
            if req.kv_src is None:
                fe.fail(req, InstanceLostError("a decode dispatch came before any KV transfer"))
                return
            req.pending = a
            self._export(req, req.kv_src, h, a.imported_tokens)
            return
        self._send_add(req, h, a)

    def _report_route(self, req: LiveRequest, h: InstanceHandle, a: ev.Dispatch) -> None:
        """Tell the request tracer (if any) where the controller sent the request and what that instance looked like."""
        listener = getattr(self.fe, "route_listener", None)
        if listener is None:
            return
        st = h.status
        reason = {"controller": type(getattr(self.fe, "controller", None)).__name__, "phase": st.phase if st else None,
                  "window_open": h.window_open, "free_kv_tokens": st.free_kv_tokens if st else None,
                  "num_requests": len(st.requests) if st else None, "imported_tokens": a.imported_tokens,
                  "reroute": req.lost_from is not None}
        try:
            listener(req.request_id, h.instance_id, reason)
        except Exception:  # tracing must never take routing down
            logger.exception("the route listener failed")

    def _send_add(self, req: LiveRequest, h: InstanceHandle, a: ev.Dispatch) -> None:
        remaining = req.remaining_tokens(self.max_model_len)
        limit = min(remaining, a.max_tokens)
        req.continues = limit < remaining
        if req.continues and req.params.n > 1:
            self.fe.fail(req, ValueError("n > 1 is not supported by disaggregated (FuDG) strategies"))
            return
        ids, produced = req.prompt_token_ids, req.output_token_ids()
        params = req.params.clone(max_tokens=limit)
        if produced:  # the decode leg (KV imported) or a migration: the prompt and the tokens produced so far
            ids = ids + produced
            params = params.clone(min_tokens=max(req.params.min_tokens - req.num_output_tokens, 0),
                                  prompt_logprobs=None)
        req.instance = h.instance_id
        seq = self.fe.board.dispatched(h, req.request_id, len(ids), time.monotonic())
        self.fe.send(h, m.AddRequest(seq, req.request_id, ids, params, req.prompt, req.continues, a.imported_tokens,
                                     len(produced), num_output_chars=req.num_output_chars() if produced else 0,
                                     lora=m.LoRAAdapter.of(req.lora) if req.lora is not None else None))

    def finish(self, a: ev.FinishRequest) -> None:
        req = self.fe.requests.get(a.request_id)
        if req is not None:
            self.fe.end(req, InstanceLostError(a.reason))

    # ---- KV transfers ------------------------------------------------------------------------
    def transfer(self, a: ev.TransferKV) -> None:
        """Ship KV to `a.dst`; to STAGING, the prefill instance keeps it pinned until a decode dispatch names one."""
        fe = self.fe
        req = fe.requests.get(a.request_id)
        if req is None:
            return
        req.kv_src = a.src
        if a.dst == ev.STAGING:
            fe.post(ev.TransferDone(a.request_id, a.src, a.dst, a.nbytes))
            return
        dst = fe.board.instances.get(a.dst)
        if dst is None:
            fe.fail(req, InstanceLostError(f"KV transfer of {a.request_id} to unknown instance {a.dst}"))
            return
        self._export(req, a.src, dst, a.num_tokens)

    def _export(self, req: LiveRequest, src_id: int, dst: InstanceHandle, num_tokens: int) -> None:
        fe = self.fe
        src = fe.board.instances.get(src_id)
        if src is None or dst.ready is None or "lost" in (src.state, dst.state):
            fe.fail(req, InstanceLostError(f"KV transfer of {req.request_id}: instance lost"))
            return
        tid = req.transfer = next(self.transfer_ids)
        dst.requests.add(req.request_id)  # an abort now also frees what it has imported
        fe.send(dst, m.ExpectKV(req.request_id, tid, num_tokens, src_id))  # the only transfer it will accept
        fe.send(src, m.ExportKV(req.request_id, num_tokens, dst.ready.kv_address, tid))
        fe.call_later(self.kv_transfer_timeout_s, self._transfer_deadline, req, tid)

    def kv_arrived(self, req: LiveRequest, dst: InstanceHandle, src: int, nbytes: int) -> None:
        """The destination holds the request's KV: go on with the decode dispatch, or tell the controller."""
        req.transfer, req.kv_dst = None, dst.instance_id
        holder = self.fe.board.instances.get(src)
        if holder is not None:
            holder.requests.discard(req.request_id)
        self.kv_bytes_moved += nbytes
        if req.pending is not None:
            a, req.pending = req.pending, None
            self._send_add(req, dst, a)
        else:
            self.fe.post(ev.TransferDone(req.request_id, src, dst.instance_id, nbytes))

    def _transfer_deadline(self, req: LiveRequest, tid: int) -> None:
        if not req.done and req.transfer == tid:
            logger.error("KV transfer of %s did not arrive within %.1f s", req.request_id, self.kv_transfer_timeout_s)
            self.fe.fail(req, InstanceLostError(f"the KV transfer of {req.request_id} timed out"))

    # ---- instances ---------------------------------------------------------------------------
    def window(self, a: ev.OpenWindow | ev.CloseWindow) -> None:
        h = self.fe.board.instances.get(a.instance_id)
        if h is None or h.identity is None or h.state == "lost":
            return
        opening = isinstance(a, ev.OpenWindow)
        self.fe.board.window_set(h, opening, time.monotonic())
        self.fe.send(h, m.SetWindow(opening))

    def hold(self, a: ev.HoldOutput | ev.ReleaseOutput) -> None:
        h = self.fe.board.instances.get(a.instance_id)
        if h is None:
            return
        h.held = isinstance(a, ev.HoldOutput)
        if not h.held:
            for req in list(self.fe.requests.values()):
                if req.instance == a.instance_id:
                    self.fe.release(req)

    def scale(self, a: ev.Scale) -> None:
        """A mitosis step: the controller's topology already shows it (/cluster reads it from there)."""
        self.mitosis_events += 1
        logger.info("mitosis: %s on macro instance %d, instances %s", a.kind, a.macro, list(a.instances))

    def timer(self, a: ev.SetTimer) -> None:
        self.fe.call_later(max(a.time - time.monotonic(), 0.0), self.fe.post, ev.TimerFired(a.name))
