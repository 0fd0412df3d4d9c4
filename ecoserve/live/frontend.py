"""ClusterEngine: the frontend of a live cluster, offering the AsyncEngine interface the server uses.

It owns the tokenizer-side model facts, a cluster controller (the routing policy, from
`ecoserve.cluster`), one ZeroMQ ROUTER socket that every instance connects to, and the board of
instances. Requests enter here and become events for the controller; the controller's actions are
carried out by `actions.py`, instance messages are read by `receive.py`, and `watch.py` watches
heartbeats, exits and deadlines. Everything runs on the server's event loop; every wait has a deadline.
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
from ecoserve.live.actions import apply_actions
from ecoserve.live.board import InstanceBoard, InstanceHandle
from ecoserve.live.errors import UnroutableError
from ecoserve.live.requests import LiveRequest
from ecoserve.live.watch import lose, receive, watch
from ecoserve.request import RequestOutput
from ecoserve.sampling import SamplingParams

logger = logging.getLogger(__name__)

# (prefill step time of n tokens, the board's status reader) -> a ClusterController
ControllerFactory = Callable[[Callable[[int], float], Callable[[int], Any]], Any]


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
        self.transfer_ids = itertools.count(1)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ctx: zmq.asyncio.Context | None = None
        self.sock: zmq.asyncio.Socket | None = None
        self.address: str | None = None
        self._tasks: list[asyncio.Task] = []
        self.early: list[ev.Event] = []  # joins and arrivals before the controller exists
        self.ready = asyncio.Event()
        self.ready_deadline = float("inf")  # set at start: launched instances must have joined by then
        self._accepting = True
        self.dead_error: BaseException | None = None
        self.pid_to_id: dict[int, int] = {}

    # ---- lifecycle -----------------------------------------------------------------------
    def start(self) -> None:
        if self._loop is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._ctx = zmq.asyncio.Context()
        self.sock = self._ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to a vanished peer fails instead of vanishing
        host, port = self.opts.bind.rsplit(":", 1)
        if port == "0":
            self.address = f"{host}:{self.sock.bind_to_random_port(host)}"
        else:
            self.sock.bind(self.opts.bind)
            self.address = self.opts.bind
        for iid in self.planned:
            self.board.add(InstanceHandle(iid))
        if self.launcher is not None:
            for iid in self.planned:
                pid = self.launcher.launch(iid, self.address)
                if pid is not None:
                    self.pid_to_id[pid] = iid
        self.ready_deadline = time.monotonic() + self.opts.ready_timeout_s
        self._tasks = [asyncio.create_task(receive(self)), asyncio.create_task(watch(self))]
        logger.info("frontend listening on %s for %d instance(s)", self.address, len(self.planned))

    def call_later(self, delay_s: float, fn: Callable[..., None], *args: Any) -> None:
        self._loop.call_later(delay_s, fn, *args)

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
        self._loop.call_later(grace_s, self.fail_all, EngineShutdownError("the server is shutting down"))

    async def stop(self, timeout_s: float = 5.0) -> None:
        self._accepting = False
        self.fail_all(EngineShutdownError("the server is shutting down"))
        for h in self.board.instances.values():
            if h.identity is not None and h.state != "lost":
                self.send(h, m.Shutdown())
        await asyncio.sleep(0.05)  # let the shutdowns leave
        for t in self._tasks:
            t.cancel()
        if self.launcher is not None:
            await asyncio.get_running_loop().run_in_executor(None, self.launcher.shutdown, timeout_s)
        if self.sock is not None:
            self.sock.close(0)
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
        self.post(ev.RequestArrived(request_id, len(req.prompt_token_ids),
                                    req.remaining_tokens(self.engine.max_model_len), arrival))
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
        self.end(req)
        if self.observer is not None:
            self.observer.on_abort([request_id])
        self.post(ev.RequestAborted(request_id))

    # ---- what the action, receive and watch modules share ---------------------------------------
    def post(self, event: ev.Event) -> None:
        """An event to the controller; its actions are carried out at once."""
        if self.controller is None:
            if isinstance(event, (ev.RequestArrived, ev.InstanceJoined)):
                self.early.append(event)
            return  # statuses are read from the board on demand; nothing else can happen yet
        try:
            actions = self.controller.handle(event)
        except Exception as err:
            logger.exception("the cluster controller failed on %s", type(event).__name__)
            self._end_stranded(event, err)
            return
        apply_actions(self, actions)

    def _end_stranded(self, event: ev.Event, err: Exception) -> None:
        """A controller that could not act must not leave requests waiting for their deadline: end the
        arriving request, or those of a lost instance (none of them was re-routed), with a clear error."""
        if isinstance(event, ev.RequestArrived):
            stranded = [self.requests.get(event.request_id)]
        elif isinstance(event, ev.InstanceLost):
            stranded = [r for r in self.requests.values() if r.instance == event.instance_id]
        else:
            return
        for req in stranded:
            if req is not None and not req.done:
                self.fail(req, UnroutableError(f"the cluster could not place request {req.request_id!r}: {err!r}"))

    def send(self, h: InstanceHandle, msg: m.Msg) -> None:
        try:
            self.sock.send_multipart([h.identity, m.encode(msg)], flags=zmq.NOBLOCK)
        except zmq.ZMQError as e:  # EHOSTUNREACH: its connection is gone
            if h.state != "lost":
                lose(self, h, f"send failed: {e}")

    def end(self, req: LiveRequest, error: BaseException | None = None) -> None:
        """Forget a request; abort it wherever it still runs; hand `error` to its client."""
        req.done = True
        self.requests.pop(req.request_id, None)
        self.board.forget(req.request_id)
        for h in self.board.instances.values():
            if req.request_id in h.requests:
                h.requests.discard(req.request_id)
                if h.state != "lost":
                    self.send(h, m.Abort([req.request_id]))
        if error is not None:
            req.outputs.put_nowait(error)

    def fail(self, req: LiveRequest, error: BaseException) -> None:
        """End a request with `error` and tell the controller it is gone."""
        self.end(req, error)
        self.post(ev.RequestAborted(req.request_id))

    def fail_all(self, error: BaseException) -> None:
        for req in list(self.requests.values()):
            self.end(req, error)

    def deliver(self, req: LiveRequest) -> None:
        """The request's news to its client, unless its instance's output is held."""
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

    def scale_by_hand(self, macro: int, delta: int) -> list[dict]:
        """POST /cluster/scale: a mitosis step on `macro` (ValueError when the controller cannot)."""
        if self.controller is None:
            raise ValueError("the cluster is still starting")
        acts = self.controller.scale_by_hand(macro, delta)
        apply_actions(self, acts)
        return [{"kind": a.kind, "macro": a.macro, "instances": list(a.instances), "other": a.other}
                for a in acts if isinstance(a, ev.Scale)]
