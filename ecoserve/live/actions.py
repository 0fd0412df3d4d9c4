"""The controller's actions carried out on real instances: dispatch, KV transfer, windows, output hold,
scale, finish, timers (the other direction from `receive.py`).

A dispatch becomes an `AddRequest` on the instance's connection; a decode dispatch whose KV is still
on the prefill side first asks that instance to export it to the destination's KV receiver; every
transfer has a deadline.
"""
from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, Callable

from ecoserve.cluster import events as ev
from ecoserve.live import messages as m
from ecoserve.live.board import InstanceHandle
from ecoserve.live.errors import InstanceLostError
from ecoserve.live.requests import LiveRequest

if TYPE_CHECKING:
    from ecoserve.live.frontend import ClusterEngine

logger = logging.getLogger(__name__)

def apply_actions(fe: "ClusterEngine", actions: list[ev.Action]) -> None:
    for a in actions:
        handler = _ACTIONS.get(type(a))
        if handler is None:
            logger.error("unknown controller action %r", a)
            continue
        handler(fe, a)


def dispatch(fe: "ClusterEngine", a: ev.Dispatch) -> None:
    req = fe.requests.get(a.request_id)
    h = fe.board.instances.get(a.instance_id)
    if req is None:
        return
    if h is None or h.state in ("lost", "starting") or h.identity is None:
        fe.fail(req, InstanceLostError(f"the controller sent the request to unusable instance {a.instance_id}"))
        return
    if req.streamed and not a.imported_tokens:
        fe.fail(req, InstanceLostError("the request had streamed tokens and cannot move to another instance"))
        return
    if req.lost_from is not None:
        req.lost_from = None
        req.reroutes += 1
        fe.counters["reroutes"] += 1
    if req.first_scheduled is None:
        req.first_scheduled = time.monotonic()
    if a.imported_tokens and req.kv_dst != a.instance_id:  # the KV is still on the prefill side: fetch it
        if req.kv_src is None:
            fe.fail(req, InstanceLostError("a decode dispatch came before any KV transfer"))
            return
        req.pending = a
        _export(fe, req, req.kv_src, h, a.imported_tokens)
        return
    _send_add(fe, req, h, a)


def _send_add(fe: "ClusterEngine", req: LiveRequest, h: InstanceHandle, a: ev.Dispatch) -> None:
    remaining = req.remaining_tokens(fe.engine.max_model_len)
    limit = min(remaining, a.max_tokens)
    req.continues = limit < remaining
    if req.continues and req.params.n > 1:
        fe.fail(req, ValueError("n > 1 is not supported by disaggregated (FuDG) strategies"))
        return
    ids, produced = req.prompt_token_ids, []
    params = req.params.clone(max_tokens=limit)
    if a.imported_tokens:  # the decode leg: the prompt and the tokens produced so far, their KV imported
        produced = req.output_token_ids()
        ids = ids + produced
        params = params.clone(min_tokens=max(req.params.min_tokens - req.num_output_tokens, 0),
                              prompt_logprobs=None)
    req.instance = h.instance_id
    seq = fe.board.dispatched(h, req.request_id, len(ids), time.monotonic())
    fe.send(h, m.AddRequest(seq, req.request_id, ids, params, req.prompt, req.continues, a.imported_tokens,
                            len(produced)))


def transfer(fe: "ClusterEngine", a: ev.TransferKV) -> None:
    """Ship KV to `a.dst`; to STAGING, the prefill instance keeps it pinned until a decode dispatch names one."""
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
    _export(fe, req, a.src, dst, a.num_tokens)


def _export(fe: "ClusterEngine", req: LiveRequest, src_id: int, dst: InstanceHandle, num_tokens: int) -> None:
    src = fe.board.instances.get(src_id)
    if src is None or dst.ready is None or "lost" in (src.state, dst.state):
        fe.fail(req, InstanceLostError(f"KV transfer of {req.request_id}: instance lost"))
        return
    tid = req.transfer = next(fe.transfer_ids)
    dst.requests.add(req.request_id)  # an abort now also frees what it has imported
    fe.send(src, m.ExportKV(req.request_id, num_tokens, dst.ready.kv_address, tid))
    fe.call_later(fe.opts.kv_transfer_timeout_s, _transfer_deadline, fe, req, tid)


def kv_arrived(fe: "ClusterEngine", req: LiveRequest, dst: InstanceHandle, src: int, nbytes: int) -> None:
    """The destination holds the request's KV: go on with the decode dispatch, or tell the controller."""
    req.transfer, req.kv_dst = None, dst.instance_id
    holder = fe.board.instances.get(src)
    if holder is not None:
        holder.requests.discard(req.request_id)
    fe.counters["kv_bytes_moved"] += nbytes
    if req.pending is not None:
        a, req.pending = req.pending, None
        _send_add(fe, req, dst, a)
    else:
        fe.post(ev.TransferDone(req.request_id, src, dst.instance_id, nbytes))


def _transfer_deadline(fe: "ClusterEngine", req: LiveRequest, tid: int) -> None:
    if not req.done and req.transfer == tid:
        logger.error("KV transfer of %s did not arrive within %.1f s", req.request_id, fe.opts.kv_transfer_timeout_s)
        fe.fail(req, InstanceLostError(f"the KV transfer of {req.request_id} timed out"))


def window(fe: "ClusterEngine", a: ev.OpenWindow | ev.CloseWindow) -> None:
    h = fe.board.instances.get(a.instance_id)
    if h is None or h.identity is None or h.state == "lost":
        return
    opening = isinstance(a, ev.OpenWindow)
    if opening and not h.window_open:
        h.num_windows += 1
    h.window_open = opening
    fe.send(h, m.SetWindow(opening))


def hold(fe: "ClusterEngine", a: ev.HoldOutput | ev.ReleaseOutput) -> None:
    h = fe.board.instances.get(a.instance_id)
    if h is None:
        return
    h.held = isinstance(a, ev.HoldOutput)
    if not h.held:
        for req in list(fe.requests.values()):
            if req.instance == a.instance_id and req.held:
                for o in req.held:
                    req.outputs.put_nowait(o)
                req.held.clear()


def scale(fe: "ClusterEngine", a: ev.Scale) -> None:
    """A mitosis step: /cluster's states and roles follow the controller's topology."""
    fe.scale_log.append(a)
    assign_roles(fe)


def finish(fe: "ClusterEngine", a: ev.FinishRequest) -> None:
    req = fe.requests.get(a.request_id)
    if req is not None:
        fe.end(req, InstanceLostError(a.reason))


def timer(fe: "ClusterEngine", a: ev.SetTimer) -> None:
    fe.call_later(max(a.time - time.monotonic(), 0.0), fe.post, ev.TimerFired(a.name))


def assign_roles(fe: "ClusterEngine") -> None:
    """/cluster's roles from the controller's topology: FuDG's prefill / decode, PaDG's macro ids; a started
    instance in no macro instance is free (or draining, while it finishes its requests)."""
    topo = fe.controller.topology()
    for iid, role in topo.roles.items():
        h = fe.board.instances.get(iid)
        if h is None:
            continue
        if role != "both":
            h.role = role
        elif topo.macros:
            h.role = topo.macro_of(iid)
            if h.state in ("ready", "draining", "free"):
                h.state = "draining" if iid in topo.draining else "free" if h.role is None else "ready"


_ACTIONS: dict[type, Callable[["ClusterEngine", Any], None]] = {
    ev.Dispatch: dispatch, ev.TransferKV: transfer, ev.OpenWindow: window, ev.CloseWindow: window,
    ev.HoldOutput: hold, ev.ReleaseOutput: hold, ev.Scale: scale, ev.FinishRequest: finish, ev.SetTimer: timer,
}
