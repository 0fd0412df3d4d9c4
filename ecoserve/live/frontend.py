"""ClusterEngine: the frontend of a live cluster, offering the AsyncEngine interface the server uses.

It owns the tokenizer-side model facts, a cluster controller (the routing policy, from
`ecoserve.cluster`), one ZeroMQ ROUTER socket that every instance connects to, and the board of
instances. Events (arrivals, statuses, prefills done, KV arrived, losses, timers) go to the
controller; its actions (dispatch, transfer KV, windows, output hold, scale, finish) are carried
out here. Everything runs on the server's event loop; every wait has a deadline.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

import zmq
import zmq.asyncio

from ecoserve.cluster import events as ev
from ecoserve.engine.async_engine import EngineDeadError, EngineOverloadedError, EngineShutdownError
from ecoserve.live import messages as m
from ecoserve.live.board import InstanceBoard, InstanceHandle, profile_step_time
from ecoserve.live.requests import LiveRequest
from ecoserve.request import RequestOutput
from ecoserve.sampling import SamplingParams

logger = logging.getLogger(__name__)

# (prefill step time of n tokens, the board's status reader) -> a ClusterController
ControllerFactory = Callable[[Callable[[int], float], Callable[[int], Any]], Any]


class InstanceLostError(EngineDeadError):
    """The instance serving a request was lost after it had streamed tokens (or could not be replaced)."""


class RequestTimeoutError(EngineDeadError):
    """A request passed its deadline in the cluster."""


@dataclass(frozen=True)
class FrontendOptions:
    bind: str = "tcp://127.0.0.1:0"  # the port instances connect to (0: any free port)
    heartbeat_timeout_s: float = 2.0  # an instance silent this long is lost
    ping_interval_s: float = 0.5
    request_timeout_s: float = 600.0  # every request ends by then
    kv_transfer_timeout_s: float = 10.0
    ready_timeout_s: float = 300.0  # launched instances that have not joined by then are lost
    max_waiting: int | None = None


class FrontendModel:
    """What the server handlers read as `engine.engine`: tokenizer and serving facts, no weights."""

    def __init__(self, loaded, max_model_len: int | None = None) -> None:
        from ecoserve.engine.guided import GrammarCompiler, GuidedDecoder

        self.loaded = loaded
        self.tokenizer = loaded.tokenizer
        self.model_name = loaded.name
        self.max_model_len = max_model_len or loaded.max_model_len
        # Grammars are compiled here to refuse a bad one with a 400; the instances compile their own.
        self.guided = GuidedDecoder(GrammarCompiler(self.tokenizer, loaded.spec.vocab_size,
                                                    sorted(loaded.eos_token_ids))) if self.tokenizer else None

    def validate_params(self, params: SamplingParams) -> SamplingParams:
        from ecoserve.engine.llm_engine import validate_params

        return validate_params(params, self.loaded.spec.vocab_size, self.tokenizer is not None)


class ClusterEngine:
    def __init__(self, model: FrontendModel, controller_factory: ControllerFactory, instance_ids: list[int],
                 launcher: Any | None = None, options: FrontendOptions = FrontendOptions(),
                 observer: Any | None = None, identity: str | None = None) -> None:
        self.engine = model
        self.controller_factory = controller_factory
        self.controller: Any = None  # built once every launched instance has joined (it needs their profile)
        self.launcher = launcher
        self.opts = options
        self.observer = observer
        self.max_waiting = options.max_waiting
        self.identity = identity or model.model_name  # instances must report this model
        self.board = InstanceBoard()
        self.planned = list(instance_ids)
        self.requests: dict[str, LiveRequest] = {}
        self.counters = {"reroutes": 0, "instance_deaths": 0, "kv_bytes_moved": 0, "refused_instances": 0}
        self.scale_log: list[ev.Scale] = []
        self._transfer_ids = itertools.count(1)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ctx: zmq.asyncio.Context | None = None
        self._sock: zmq.asyncio.Socket | None = None
        self.address: str | None = None
        self._tasks: list[asyncio.Task] = []
        self._early: list[ev.Event] = []  # joins and arrivals before the controller exists
        self.ready = asyncio.Event()
        self._accepting = True
        self.dead_error: BaseException | None = None
        self._pid_to_id: dict[int, int] = {}

    # ---- lifecycle -----------------------------------------------------------------------
    def start(self) -> None:
        if self._loop is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to a vanished peer fails instead of vanishing
        host, port = self.opts.bind.rsplit(":", 1)
        if port == "0":
            self.address = f"{host}:{self._sock.bind_to_random_port(host)}"
        else:
            self._sock.bind(self.opts.bind)
            self.address = self.opts.bind
        for iid in self.planned:
            self.board.add(InstanceHandle(iid))
        if self.launcher is not None:
            for iid in self.planned:
                pid = self.launcher.launch(iid, self.address)
                if pid is not None:
                    self._pid_to_id[pid] = iid
        self._ready_deadline = time.monotonic() + self.opts.ready_timeout_s
        self._tasks = [asyncio.create_task(self._receive()), asyncio.create_task(self._watch())]
        logger.info("frontend listening on %s for %d instance(s)", self.address, len(self.planned))

    async def wait_ready(self, timeout_s: float) -> None:
        await asyncio.wait_for(self.ready.wait(), timeout_s)

    @property
    def is_running(self) -> bool:
        return self.ready.is_set() and self.dead_error is None and bool(self.board.live())

    @property
    def num_in_flight(self) -> int:
        return len(self.requests)

    def begin_shutdown(self, grace_s: float) -> None:
        if not self._accepting:
            return
        self._accepting = False
        assert self._loop is not None
        self._loop.call_later(grace_s, self._fail_all, EngineShutdownError("the server is shutting down"))

    async def stop(self, timeout_s: float = 5.0) -> None:
        self._accepting = False
        self._fail_all(EngineShutdownError("the server is shutting down"))
        for h in self.board.instances.values():
            if h.identity is not None and h.state != "lost":
                self._send(h, m.Shutdown())
        await asyncio.sleep(0.05)  # let the shutdowns leave
        for t in self._tasks:
            t.cancel()
        if self.launcher is not None:
            await asyncio.get_running_loop().run_in_executor(None, self.launcher.shutdown, timeout_s)
        if self._sock is not None:
            self._sock.close(0)
            self._ctx.term()

    # ---- the AsyncEngine interface -----------------------------------------------------------
    def num_waiting(self) -> int:
        return sum(1 for r in self.requests.values() if r.instance is None)

    def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 prompt: str | None = None, arrival_time: float | None = None) -> AsyncIterator[RequestOutput]:
        if self.dead_error is not None:
            raise EngineDeadError(f"the cluster frontend failed: {self.dead_error!r}")
        if not self._accepting or self._loop is None:
            raise EngineShutdownError("the server is shutting down" if self._loop else "the cluster is not started")
        if self.max_waiting is not None and self.num_waiting() >= self.max_waiting:
            raise EngineOverloadedError(f"the waiting queue is full ({self.max_waiting} requests); retry later")
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        self._validate(prompt_token_ids)
        params = self.engine.validate_params(params)
        now = time.monotonic()
        arrival = now if arrival_time is None else arrival_time
        req = LiveRequest(request_id, prompt, list(prompt_token_ids), params, arrival,
                          now + self.opts.request_timeout_s)
        self.requests[request_id] = req
        self._arrive(req)
        return self._iterate(req)

    def _validate(self, ids: list[int]) -> None:
        if not ids:
            raise ValueError("the prompt is empty: at least one token is needed")
        if len(ids) > self.engine.max_model_len:
            raise ValueError(f"the prompt has {len(ids)} tokens, more than max_model_len ({self.engine.max_model_len})")
        vocab = self.engine.loaded.spec.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids must be in [0, {vocab}); got {bad[:5]}")

    async def _iterate(self, req: LiveRequest) -> AsyncIterator[RequestOutput]:
        try:
            while True:
                item = await req.outputs.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    return
        finally:
            if not req.done:  # the consumer went away, or an error: free the request everywhere
                self.abort(req.request_id)

    def abort(self, request_id: str) -> None:
        req = self.requests.get(request_id)
        if req is None or req.done:
            return
        self._end(req)
        if self.observer is not None:
            self.observer.on_abort([request_id])
        self._post(ev.RequestAborted(request_id))

    # ---- requests ------------------------------------------------------------------------
    def _arrive(self, req: LiveRequest) -> None:
        self._post(ev.RequestArrived(req.request_id, len(req.prompt_token_ids),
                                     req.remaining_tokens(self.engine.max_model_len), req.arrival))

    def _end(self, req: LiveRequest, error: BaseException | None = None) -> None:
        """Forget a request; abort it wherever it still runs; hand `error` to its client."""
        req.done = True
        self.requests.pop(req.request_id, None)
        self.board.forget(req.request_id)
        for h in self.board.instances.values():
            if req.request_id in h.requests:
                h.requests.discard(req.request_id)
                if h.state != "lost":
                    self._send(h, m.Abort([req.request_id]))
        if error is not None:
            req.outputs.put_nowait(error)

    def _deliver(self, req: LiveRequest) -> None:
        out = req.output()
        h = self.board.instances.get(req.instance) if req.instance is not None else None
        if h is not None and h.held and not out.finished:
            req.held.append(out)
            return
        for o in req.held:
            req.outputs.put_nowait(o)
        req.held.clear()
        req.outputs.put_nowait(out)
        if self.observer is not None:
            self.observer.on_step([out])

    # ---- controller --------------------------------------------------------------------------
    def _post(self, event: ev.Event) -> None:
        if self.controller is None:
            if isinstance(event, (ev.RequestArrived, ev.InstanceJoined)):
                self._early.append(event)
            return  # statuses are read from the board on demand; nothing else can happen yet
        try:
            actions = self.controller.handle(event)
        except Exception:
            logger.exception("the cluster controller failed on %s", type(event).__name__)
            return
        self._act(actions)

    def _act(self, actions: list[ev.Action]) -> None:
        for a in actions:
            try:
                handler = _ACTIONS[type(a)]
            except KeyError:
                logger.error("unknown controller action %r", a)
                continue
            handler(self, a)

    def _dispatch(self, a: ev.Dispatch) -> None:
        req = self.requests.get(a.request_id)
        h = self.board.instances.get(a.instance_id)
        if req is None:
            return
        if h is None or h.state in ("lost", "starting") or h.identity is None:
            self._end(req, InstanceLostError(f"the controller sent the request to unusable instance {a.instance_id}"))
            self._post(ev.RequestAborted(req.request_id))
            return
        if req.streamed and not a.imported_tokens:
            self._end(req, InstanceLostError("the request had streamed tokens and cannot move to another instance"))
            self._post(ev.RequestAborted(req.request_id))
            return
        if req.lost_from is not None:
            req.lost_from = None
            req.reroutes += 1
            self.counters["reroutes"] += 1
        now = time.monotonic()
        if req.first_scheduled is None:
            req.first_scheduled = now
        if a.imported_tokens and req.kv_dst != a.instance_id:  # the KV is still on the prefill side: fetch it
            if req.kv_src is None:
                self._end(req, InstanceLostError("a decode dispatch came before any KV transfer"))
                self._post(ev.RequestAborted(req.request_id))
                return
            req.pending = a
            self._export(req, req.kv_src, h, a.imported_tokens)
            return
        self._send_add(req, h, a)

    def _send_add(self, req: LiveRequest, h: InstanceHandle, a: ev.Dispatch) -> None:
        remaining = req.remaining_tokens(self.engine.max_model_len)
        limit = min(remaining, a.max_tokens)
        req.continues = limit < remaining
        if req.continues and req.params.n > 1:
            self._end(req, ValueError("n > 1 is not supported by disaggregated (FuDG) strategies"))
            self._post(ev.RequestAborted(req.request_id))
            return
        ids = req.prompt_token_ids
        params = req.params.clone(max_tokens=limit)
        if a.imported_tokens:  # the decode leg: the prompt and the tokens produced so far, their KV imported
            ids = ids + req.output_token_ids()
            params = params.clone(min_tokens=max(req.params.min_tokens - req.num_output_tokens, 0),
                                  prompt_logprobs=None)
        req.instance = h.instance_id
        seq = self.board.dispatched(h, req.request_id, len(ids), time.monotonic())
        self._send(h, m.AddRequest(seq, req.request_id, ids, params, req.prompt, req.continues, a.imported_tokens))

    def _transfer(self, a: ev.TransferKV) -> None:
        """Ship KV to `a.dst`; to STAGING, the prefill instance keeps it pinned until a decode dispatch names one."""
        req = self.requests.get(a.request_id)
        if req is None:
            return
        req.kv_src = a.src
        if a.dst == ev.STAGING:
            self._post(ev.TransferDone(a.request_id, a.src, a.dst, a.nbytes))
            return
        dst = self.board.instances.get(a.dst)
        if dst is None:
            self._end(req, InstanceLostError(f"KV transfer of {a.request_id} to unknown instance {a.dst}"))
            self._post(ev.RequestAborted(req.request_id))
            return
        self._export(req, a.src, dst, a.num_tokens)

    def _export(self, req: LiveRequest, src_id: int, dst: InstanceHandle, num_tokens: int) -> None:
        src = self.board.instances.get(src_id)
        if src is None or dst.ready is None or "lost" in (src.state, dst.state):
            self._end(req, InstanceLostError(f"KV transfer of {req.request_id}: instance lost"))
            self._post(ev.RequestAborted(req.request_id))
            return
        tid = req.transfer = next(self._transfer_ids)
        dst.requests.add(req.request_id)  # an abort now also frees what it has imported
        self._send(src, m.ExportKV(req.request_id, num_tokens, dst.ready.kv_address, tid))
        self._loop.call_later(self.opts.kv_transfer_timeout_s, self._transfer_deadline, req, tid)

    def kv_arrived(self, req: LiveRequest, dst: InstanceHandle, src: int, nbytes: int) -> None:
        """The destination holds the request's KV: go on with the decode dispatch, or tell the controller."""
        req.transfer, req.kv_dst = None, dst.instance_id
        holder = self.board.instances.get(src)
        if holder is not None:
            holder.requests.discard(req.request_id)
        self.counters["kv_bytes_moved"] += nbytes
        if req.pending is not None:
            a, req.pending = req.pending, None
            self._send_add(req, dst, a)
        else:
            self._post(ev.TransferDone(req.request_id, src, dst.instance_id, nbytes))

    def _transfer_deadline(self, req: LiveRequest, tid: int) -> None:
        if not req.done and req.transfer == tid:
            logger.error("KV transfer of %s did not arrive within %.1f s", req.request_id,
                         self.opts.kv_transfer_timeout_s)
            self._end(req, InstanceLostError(f"the KV transfer of {req.request_id} timed out"))
            self._post(ev.RequestAborted(req.request_id))

    def _window(self, a: ev.OpenWindow | ev.CloseWindow) -> None:
        h = self.board.instances.get(a.instance_id)
        if h is None or h.identity is None or h.state == "lost":
            return
        opening = isinstance(a, ev.OpenWindow)
        if opening and not h.window_open:
            h.num_windows += 1
        h.window_open = opening
        self._send(h, m.SetWindow(opening))

    def _hold(self, a: ev.HoldOutput | ev.ReleaseOutput) -> None:
        h = self.board.instances.get(a.instance_id)
        if h is None:
            return
        h.held = isinstance(a, ev.HoldOutput)
        if not h.held:
            for req in list(self.requests.values()):
                if req.instance == a.instance_id and req.held:
                    for o in req.held:
                        req.outputs.put_nowait(o)
                    req.held.clear()

    def _scale(self, a: ev.Scale) -> None:
        self.scale_log.append(a)
        ids = list(a.instances)
        for iid in ids:
            h = self.board.instances.get(iid)
            if h is None or h.state == "lost":
                continue
            if a.kind == "drain":
                h.state = "draining"
            elif a.kind == "release":
                h.state, h.role = "free", None
            elif a.kind == "add":
                h.state, h.role = "ready", a.macro
            elif a.kind == "split":  # the added instance and those moved form the new macro
                h.state, h.role = "ready", a.other
        if a.kind == "merge":
            for h in self.board.instances.values():
                if h.role == a.other:
                    h.role = a.macro

    def _finish(self, a: ev.FinishRequest) -> None:
        req = self.requests.get(a.request_id)
        if req is not None:
            self._end(req, InstanceLostError(a.reason))

    def _timer(self, a: ev.SetTimer) -> None:
        delay = max(a.time - time.monotonic(), 0.0)
        self._loop.call_later(delay, self._post, ev.TimerFired(a.name))

    def scale_by_hand(self, macro: int, delta: int) -> list[dict]:
        """POST /cluster/scale: a mitosis step on `macro` (ValueError when the controller cannot)."""
        from ecoserve.cluster.manual import scale_by_hand
        if self.controller is None:
            raise ValueError("the cluster is still starting")
        acts = scale_by_hand(self.controller, macro, delta)
        self._act(acts)
        return [{"kind": a.kind, "macro": a.macro, "instances": list(a.instances), "other": a.other}
                for a in acts if isinstance(a, ev.Scale)]

    def _roles(self) -> None:
        """/cluster's roles at launch: FuDG's prefill / decode, PaDG's macro ids; outside any macro: free."""
        macros = getattr(self.controller, "macros", None)
        for iid, setup in getattr(self.controller, "setups", {}).items():
            h = self.board.instances.get(iid)
            if h is None:
                continue
            if setup.role in ("prefill", "decode"):
                h.role = setup.role
            elif macros is not None:
                h.role = next((mid for mid, mac in macros.items() if iid in mac.instances), None)
                if h.role is None and h.state == "ready":
                    h.state = "free"

    # ---- instances -------------------------------------------------------------------------
    def _send(self, h: InstanceHandle, msg: m.Msg) -> None:
        try:
            self._sock.send_multipart([h.identity, m.encode(msg)], flags=zmq.NOBLOCK)
        except zmq.ZMQError as e:  # EHOSTUNREACH: its connection is gone
            if h.state != "lost":
                self._lose(h, f"send failed: {e}")

    async def _receive(self) -> None:
        from ecoserve.live.receive import handle_frame
        while True:
            try:
                frames = await self._sock.recv_multipart()
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
                handle_frame(self, frames[0], frames[1])
            except Exception:
                logger.exception("handling a message from an instance failed")

    async def _watch(self) -> None:
        """Heartbeats, process exits, deadlines: every 100 ms."""
        last_ping = 0.0
        while True:
            await asyncio.sleep(0.1)
            now = time.monotonic()
            try:
                self._check_instances(now)
                if now - last_ping >= self.opts.ping_interval_s:
                    last_ping = now
                    for h in self.board.instances.values():
                        if h.identity is not None and h.state != "lost":
                            self._send(h, m.Ping(now))
                for req in [r for r in self.requests.values() if now > r.deadline]:
                    logger.warning("request %s passed its deadline", req.request_id)
                    self._end(req, RequestTimeoutError(
                        f"the request did not finish within {self.opts.request_timeout_s:.0f} s"))
                    self._post(ev.RequestAborted(req.request_id))
            except Exception:
                logger.exception("the frontend watchdog failed")

    def _check_instances(self, now: float) -> None:
        for h in list(self.board.instances.values()):
            if h.state == "lost":
                continue
            code = self.launcher.exit_code(h.instance_id) if self.launcher is not None else None
            if code is not None:
                self._lose(h, f"process exited with code {code}")
            elif h.state != "starting" and now - h.last_heard > self.opts.heartbeat_timeout_s:
                self._lose(h, f"no heartbeat for {now - h.last_heard:.1f} s")
            elif h.state == "starting" and now > self._ready_deadline:
                self._lose(h, f"did not join within {self.opts.ready_timeout_s:.0f} s")
        self._check_ready()

    def _check_ready(self) -> None:
        """Once every launched instance joined (or was lost): build the controller, replay what waited."""
        if self.ready.is_set() or any(self.board[i].state == "starting" for i in self.planned):
            return
        joined = [h for h in self.board.instances.values() if h.ready is not None]
        if not joined:
            self.dead_error = RuntimeError("no instance joined the cluster")
            self._fail_all(EngineDeadError("no instance joined the cluster"))
            self.ready.set()
            return
        self.controller = self.controller_factory(profile_step_time(joined[0].ready.profile), self.board.status_of)
        self._roles()
        self.ready.set()
        self._act(self.controller.start())
        early, self._early = self._early, []
        for event in early:
            if not isinstance(event, ev.RequestArrived) or event.request_id in self.requests:
                self._post(event)
        for h in self.board.instances.values():
            if h.state == "lost" and h.ready is not None:
                self._post(ev.InstanceLost(h.instance_id))

    def _lose(self, h: InstanceHandle, reason: str) -> None:
        """Declare an instance lost: its streaming requests end with an error; the controller re-routes the rest."""
        logger.error("instance %d lost: %s", h.instance_id, reason)
        h.state, h.lost_reason = "lost", reason
        self.counters["instance_deaths"] += 1
        if self.launcher is not None:
            self.launcher.kill(h.instance_id)
        for rid in list(h.requests):
            h.requests.discard(rid)
            req = self.requests.get(rid)
            if req is None:
                continue
            if req.streamed or req.transfer is not None:
                self._end(req, InstanceLostError(f"the instance serving this request was lost ({reason})"))
                self._post(ev.RequestAborted(rid))
            else:
                req.lost_from = h.instance_id  # the controller's re-route will count
        if h.ready is not None:
            self._post(ev.InstanceLost(h.instance_id))

    def _fail_all(self, error: BaseException) -> None:
        for req in list(self.requests.values()):
            self._end(req, error)


_ACTIONS: dict[type, Callable[[ClusterEngine, Any], None]] = {
    ev.Dispatch: ClusterEngine._dispatch, ev.TransferKV: ClusterEngine._transfer,
    ev.OpenWindow: ClusterEngine._window, ev.CloseWindow: ClusterEngine._window,
    ev.HoldOutput: ClusterEngine._hold, ev.ReleaseOutput: ClusterEngine._hold, ev.Scale: ClusterEngine._scale,
    ev.FinishRequest: ClusterEngine._finish, ev.SetTimer: ClusterEngine._timer,
}
