"""ClusterEngine: the frontend of a live cluster, the server's `EngineClient` over instance processes.

It owns the model facts the server reads, a cluster controller (the routing policy, from
`ecoserve.cluster`), one ZeroMQ ROUTER socket that every instance connects to, the board of
instances and the requests. Requests enter here and become events for the controller; four
collaborators do the rest: the `Dispatcher` carries out the controller's actions, the `Receiver`
reads the instances' messages, the `HealthWatch` watches heartbeats, exits and deadlines, the
`Supervisor` restarts lost instances. Everything runs on the server's event loop; every wait has
a deadline.
"""
from __future__ import annotations

import asyncio
import logging
import os
import time
import weakref
from typing import Any, Callable

import zmq
import zmq.asyncio
from zmq.auth.thread import ThreadAuthenticator

from ecoserve.cluster import events as ev
from ecoserve.cluster.controller import NoInstanceError
from ecoserve.cluster.profile import StepTimeTable
from ecoserve.cluster.timeline import ClusterTimeline, TimelineRecorder
from ecoserve.cluster.topology import Topology
from ecoserve.engine.async_engine import (EngineDeadError, EngineOverloadedError, EngineShutdownError, ModelFacts,
                                          StepObserver, check_grammar)
from ecoserve.engine.guided import GrammarCompiler
from ecoserve.engine.llm_engine import validate_params
from ecoserve.live import messages as m
from ecoserve.live.actions import Dispatcher
from ecoserve.live.auth import make_server, start_authenticator
from ecoserve.live.board import InstanceBoard, InstanceHandle, InstanceView, WindowLengths, view_of
from ecoserve.live.errors import UnroutableError
from ecoserve.live.launchers import Launcher
from ecoserve.live.receive import Receiver
from ecoserve.live.requests import LiveRequest
from ecoserve.live.routes import ClusterCollector
from ecoserve.live.shared import FrontendOptions
from ecoserve.live.supervisor import Supervisor
from ecoserve.live.watch import HealthWatch
from ecoserve.request import RequestOutput
from ecoserve.sampling import SamplingParams
from ecoserve.structured import StructuredOutputsParams

logger = logging.getLogger(__name__)

UNREACHABLE_GRACE_S = 1.0  # a send found the instance's connection gone: lost this long after, unless already

# (prefill step time of n tokens, the board's status reader) -> a ClusterController
ControllerFactory = Callable[[Callable[[int], float], Callable[[int], Any]], Any]
MAX_DRAIN = 100_000  # messages one drain of the socket handles at most


class ClusterStream:
    """Async iterator over one cluster request's outputs; the last one has `finished` set.

    Ending it early in any way (`aclose()`, an error, a cancelled consumer, or dropping it, started
    or not) aborts the request, as the single engine's `RequestStream` does.
    """

    def __init__(self, fe: "ClusterEngine", req: LiveRequest) -> None:
        self._fe, self._req = fe, req
        self._done = False
        self._abandoned = weakref.finalize(self, fe.abort_soon, req.request_id)  # dropped: from the collector

    def __aiter__(self) -> "ClusterStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        try:
            item = await self._req.outputs.get()
        except BaseException:  # the consumer was cancelled
            self._close()
            raise
        if isinstance(item, BaseException):
            self._close()
            raise item
        if item.finished:
            self._done = True
            self._abandoned.detach()
        return item

    async def aclose(self) -> None:
        self._close()

    def _close(self) -> None:
        self._done = True
        if self._abandoned.detach() is not None:
            self._fe.abort(self._req.request_id)


class ClusterEngine:
    def __init__(self, model: ModelFacts, controller_factory: ControllerFactory, instance_ids: list[int],
                 launcher: Launcher | None = None, options: FrontendOptions = FrontendOptions(),
                 observer: StepObserver | None = None, identity: str | None = None) -> None:
        self.model = model
        self.max_model_len = model.max_model_len
        self.observer = observer
        self.route_listener: Callable[[str, int, dict[str, Any]], None] | None = None  # the request tracer's
        self.dead_error: BaseException | None = None
        # Grammars are compiled here to refuse a bad one with a 400; the instances compile their own.
        self._grammars = GrammarCompiler(model.tokenizer, model.vocab_size,
                                         sorted(model.eos_token_ids)) if model.tokenizer else None
        self.controller_factory = controller_factory
        self.controller: Any = None  # built once every launched instance has joined (it needs their profile)
        self.launcher = launcher
        self.opts = options
        self.board = InstanceBoard()
        self.planned = list(instance_ids)
        self.timeline = TimelineRecorder(self.planned)  # bounded: the last events of each kind
        self._started = time.monotonic()  # the timeline's zero
        self.requests: dict[str, LiveRequest] = {}
        self.dispatcher = Dispatcher(self, model.max_model_len, options.kv_transfer_timeout_s)
        self.receiver = Receiver(self, self.dispatcher, identity or model.name, self.planned, launcher is not None)
        self.supervisor = Supervisor(self.board, self.planned, options, launcher, self.receiver.expect)
        self.health = HealthWatch(self, options, launcher, self.supervisor)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ctx: zmq.asyncio.Context | None = None
        self.sock: zmq.asyncio.Socket | None = None
        self._drain_sock: zmq.Socket | None = None  # a blocking view of `sock`, to read what is queued now
        self._authenticator: ThreadAuthenticator | None = None
        self._unreachable: set[int] = set()  # instances a send found gone: lost after a grace
        self.address: str | None = None
        self._tasks: list[asyncio.Task] = []
        self._early: list[ev.Event] = []  # joins and arrivals before the controller exists
        self.ready = asyncio.Event()
        self._accepting = True
        self._loras: dict[str, Any] = {}  # name -> the LoRARequest registered by add_lora

    # ---- lifecycle -----------------------------------------------------------------------
    def start(self) -> None:
        if self._loop is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._ctx = zmq.asyncio.Context()
        self.sock = self._ctx.socket(zmq.ROUTER)
        self._configure(self.sock)
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
                    self.receiver.expect(pid, iid)
        self.supervisor.started(self.address, self.planned if self.launcher is not None else [])
        self.health.arm()
        self._tasks = [asyncio.create_task(self.receiver.run(self.sock)), asyncio.create_task(self.health.run())]
        logger.info("frontend listening on %s for %d instance(s)", self.address, len(self.planned))

    def _configure(self, sock: zmq.Socket) -> None:
        """The instance port: CURVE server (with its authenticator), zero HWM, ZMTP heartbeats."""
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to a vanished peer fails instead of vanishing
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # an instance that reconnects (same routing id) takes its place
        sock.setsockopt(zmq.SNDHWM, 0)  # a busy instance's messages queue; a full queue never loses it
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.setsockopt(zmq.HEARTBEAT_IVL, 1000)  # answered by libzmq's I/O thread, not this event loop
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 5000)
        auth = self.opts.auth
        if auth is None:
            logger.warning("cluster auth is off: anyone who reaches %s can join as an instance", self.opts.bind)
            return
        self._authenticator = start_authenticator(self._ctx, auth)
        make_server(sock, auth)

    @property
    def is_running(self) -> bool:
        return self.ready.is_set() and self.dead_error is None and bool(self.board.live())

    @property
    def num_in_flight(self) -> int:
        return len(self.requests)

    def begin_shutdown(self, grace_s: float) -> None:
        """Refuse new requests; fail those still running after `grace_s`. Safe from any thread (a signal handler)."""
        if self._loop is not None:
            try:
                self._loop.call_soon_threadsafe(self._begin_shutdown, grace_s)
            except RuntimeError:  # the loop has closed
                pass

    def _begin_shutdown(self, grace_s: float) -> None:
        if not self._accepting:
            return
        self._accepting = False
        self.supervisor.stopping = True  # an instance that exits now (the terminal's SIGINT) is not replaced
        self.call_later(grace_s, self.fail_all, EngineShutdownError("the server is shutting down"))

    async def stop(self, timeout_s: float = 5.0) -> None:
        self._accepting = False
        self.supervisor.stopping = True
        self.fail_all(EngineShutdownError("the server is shutting down"))
        for h in self.board.instances.values():
            if h.identity is not None and h.state != "lost":
                self.send(h, m.Shutdown())
        await asyncio.sleep(0.05)  # let the shutdowns leave
        for t in self._tasks:
            t.cancel()
        if self.launcher is not None:
            await asyncio.get_running_loop().run_in_executor(None, self.launcher.shutdown, timeout_s)
        if self._drain_sock is not None:
            self._drain_sock.close(0)  # a shadow: the socket itself closes below
        if self.sock is not None:
            self.sock.close(0)
            if self._authenticator is not None:
                self._authenticator.stop()
            self._ctx.term()

    def check_ready(self) -> None:
        """Once every launched instance joined (or was lost for good): build the controller, replay what waited."""
        if self.ready.is_set():
            return
        for i in self.planned:
            h = self.board.instances.get(i)
            if h is not None and (h.state == "starting" or h.restart_pending):
                return
        joined = [h for h in self.board.instances.values() if h.ready is not None]
        if not joined:
            self.dead_error = RuntimeError("no instance joined the cluster")
            self.fail_all(EngineDeadError("no instance joined the cluster"))
            self.ready.set()
            return
        self.controller = self.controller_factory(StepTimeTable(joined[0].ready.profile).seconds,
                                                 self.board.status_of)
        self.ready.set()
        self.dispatcher.apply(self.controller.start())
        early, self._early = self._early, []
        for event in early:
            if not isinstance(event, ev.RequestArrived) or event.request_id in self.requests:
                self.post(event)
        for h in self.board.instances.values():
            if h.state == "lost":  # joined and lost, or never joined: the controller must not route there
                self.post(ev.InstanceLost(h.instance_id))

    # ---- requests ----------------------------------------------------------------------------
    def num_waiting(self) -> int:
        return sum(1 for r in self.requests.values() if r.instance is None)

    def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 prompt: str | None = None, arrival_time: float | None = None,
                 lora_request: Any = None) -> ClusterStream:
        if self.dead_error is not None:
            raise EngineDeadError(f"the cluster frontend failed: {self.dead_error!r}")
        if not self._accepting or self._loop is None:
            raise EngineShutdownError("the server is shutting down" if self._loop else "the cluster is not started")
        max_waiting = self.opts.max_waiting
        if max_waiting is not None and self.num_waiting() >= max_waiting:
            raise EngineOverloadedError(f"the waiting queue is full ({max_waiting} requests); retry later")
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        self._validate(prompt_token_ids)
        params = validate_params(params, self.model.vocab_size, self.model.tokenizer is not None)
        now = time.monotonic()
        arrival = now if arrival_time is None else arrival_time
        if lora_request is not None and self._loras.get(lora_request.lora_name) is not lora_request:
            raise ValueError(f"model: the LoRA adapter {lora_request.lora_name!r} is not loaded")
        req = LiveRequest(request_id, prompt, list(prompt_token_ids), params, arrival,
                          now + self.opts.request_timeout_s, lora=lora_request)
        self.requests[request_id] = req
        self.post(ev.RequestArrived(request_id, len(req.prompt_token_ids),
                                    req.remaining_tokens(self.model.max_model_len), arrival,
                                    lora_request.lora_name if lora_request is not None else None))
        return ClusterStream(self, req)

    def _validate(self, ids: list[int]) -> None:
        max_len, vocab = self.model.max_model_len, self.model.vocab_size
        if not ids:
            raise ValueError("the prompt is empty: at least one token is needed")
        if len(ids) > max_len:
            raise ValueError(f"the prompt has {len(ids)} tokens, more than max_model_len ({max_len})")
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids must be in [0, {vocab}); got {bad[:5]}")

    def abort(self, request_id: str) -> None:
        req = self.requests.get(request_id)
        if req is None or req.done:
            return
        self.end(req)
        if self.observer is not None:
            self.observer.on_abort([request_id])
        self.post(ev.RequestAborted(request_id))

    def abort_soon(self, request_id: str) -> None:
        """`abort` from any thread (a stream dropped unstarted is finalized wherever the collector runs)."""
        if self._loop is not None:
            try:
                self._loop.call_soon_threadsafe(self.abort, request_id)
            except RuntimeError:  # the loop has closed
                pass

    async def check_grammar(self, spec: StructuredOutputsParams) -> None:
        await check_grammar(self._grammars, spec)

    # ---- LoRA adapters: registered here, loaded by an instance when a request for one reaches it ----------
    async def add_lora(self, lora: Any) -> None:
        """Register an adapter whose PEFT checkpoint is readable here (the instances share the file system);
        an instance loads it with the first request routed to it, and refuses it then if its engine cannot."""
        config = os.path.join(lora.lora_path, "adapter_config.json")
        if not os.path.isfile(config):
            raise ValueError(f"no adapter found at {lora.lora_path!r}: {config} does not exist")
        self._loras[lora.lora_name] = lora

    async def remove_lora(self, lora_name: str) -> bool:
        """Forget an adapter: new requests cannot name it; instances keep it until one of that name replaces it."""
        return self._loras.pop(lora_name, None) is not None

    def lora_stats(self) -> Any:
        return None  # per instance in /cluster (`loras`); the instances' engines count loads and evictions

    # ---- what the collaborators share (`shared.Frontend`) ------------------------------------
    def post(self, event: ev.Event) -> None:
        """An event to the controller; its actions are carried out at once."""
        if self.controller is None:
            if isinstance(event, (ev.RequestArrived, ev.InstanceJoined)):
                self._early.append(event)
            return  # statuses are read from the board on demand; nothing else can happen yet
        try:
            actions = self.controller.handle(event)
        except Exception as err:
            logger.exception("the cluster controller failed on %s", type(event).__name__)
            self._end_stranded(event, err)
            return
        self._record(event, actions)
        self.dispatcher.apply(actions)

    def _record(self, event: ev.Event, actions: list[ev.Action]) -> None:
        """The timeline: phase changes from statuses, windows and dispatches from the controller's actions."""
        now, tl = time.monotonic() - self._started, self.timeline
        if isinstance(event, ev.InstanceReported):
            h = self.board.instances.get(event.instance_id)
            if h is not None and h.status is not None:
                tl.phase(now, event.instance_id, h.status.phase)
        for a in actions:
            if isinstance(a, ev.Dispatch):
                tl.routed(now, a.instance_id)
            elif isinstance(a, ev.OpenWindow):
                tl.window_opened(now, a.instance_id)
            elif isinstance(a, ev.CloseWindow):
                tl.window_closed(now, a.instance_id)

    def _end_stranded(self, event: ev.Event, err: Exception) -> None:
        """A controller that could not act must not leave requests waiting for their deadline: end the
        arriving request, or those of a lost instance (none of them was re-routed), with a clear error."""
        if isinstance(event, ev.RequestArrived):
            stranded = [self.requests.get(event.request_id)]
        elif isinstance(event, ev.InstanceLost):
            stranded = [r for r in self.requests.values() if r.instance == event.instance_id]
        else:
            return
        why = str(err) if isinstance(err, NoInstanceError) else repr(err)  # what is missing, or what broke
        for req in stranded:
            if req is not None and not req.done:
                self.fail(req, UnroutableError(f"the cluster could not place request {req.request_id!r}: {why}"))

    def send(self, h: InstanceHandle, msg: m.Msg) -> None:
        """Queue a message to an instance (never blocks: zero HWM); only a peer that is gone is lost."""
        # a non-blocking send on the asyncio socket resolves at once: its error is on the future, not raised
        sent = self.sock.send_multipart([h.identity, m.encode(msg)], flags=zmq.NOBLOCK)
        e = sent.exception() if sent.done() else None
        if e is None:
            return
        if not isinstance(e, zmq.ZMQError) or e.errno != zmq.EHOSTUNREACH:  # not the peer's fault
            logger.error("a %s to instance %d could not be queued: %s", type(msg).__name__, h.instance_id, e)
        elif self.board.instances.get(h.instance_id) is h and h.state != "lost" \
                and h.instance_id not in self._unreachable:
            # after a short grace, so that a process that is exiting is seen to exit (with its code) first
            self._unreachable.add(h.instance_id)
            self.call_later(UNREACHABLE_GRACE_S, self._lose_unreachable, h, h.restarts,
                            f"its connection is gone ({e})")

    def _lose_unreachable(self, h: InstanceHandle, restarts: int, reason: str) -> None:
        self._unreachable.discard(h.instance_id)
        if h.state != "lost" and h.restarts == restarts:  # not the process restarted in its slot since
            self.health.lose(h, reason)

    def drain(self) -> int:
        """Handle every message already queued on the instances' socket, as the receiver would."""
        if self.sock is None:
            return 0
        if self._drain_sock is None:
            self._drain_sock = zmq.Socket.shadow(self.sock.underlying)
        n = 0
        while n < MAX_DRAIN:
            try:
                frames = self._drain_sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            n += 1
            if len(frames) != 2:
                logger.warning("dropped a message of %d frames", len(frames))
                continue
            try:
                self.receiver.handle_frame(frames[0], frames[1])
            except Exception:
                logger.exception("handling a message from an instance failed")
        return n

    def call_later(self, delay_s: float, fn: Callable[..., None], *args: Any) -> None:
        self._loop.call_later(delay_s, fn, *args)

    def end(self, req: LiveRequest, error: BaseException | None = None) -> None:
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
            if self.observer is not None:  # its metrics entries go, as an aborted request's do
                self.observer.on_abort([req.request_id])

    def fail(self, req: LiveRequest, error: BaseException) -> None:
        self.end(req, error)
        self.post(ev.RequestAborted(req.request_id))

    def fail_all(self, error: BaseException) -> None:
        for req in list(self.requests.values()):
            self.end(req, error)

    def deliver(self, req: LiveRequest) -> None:
        out = req.output()
        h = self.board.instances.get(req.instance) if req.instance is not None else None
        if h is not None and h.held and not out.finished:
            req.held.append(out)
            return
        self._hand_out(req, [*req.held, out])

    def release(self, req: LiveRequest) -> None:
        if req.held:
            self._hand_out(req, list(req.held))

    def _hand_out(self, req: LiveRequest, outputs: list[RequestOutput]) -> None:
        req.held.clear()
        req.hand_out(outputs, time.monotonic())
        if self.observer is not None:
            self.observer.on_step(outputs[-1:])

    # ---- what /cluster and /metrics show -------------------------------------------------------
    @property
    def counters(self) -> dict[str, int]:
        return {"reroutes": self.dispatcher.reroutes, "instance_deaths": self.health.deaths,
                "kv_bytes_moved": self.dispatcher.kv_bytes_moved, "refused_instances": self.receiver.refused,
                "migrations": self.dispatcher.migrations, "migration_failures": self.health.migration_failures,
                "restarts": self.supervisor.restarts, "rejected_messages": self.receiver.rejected,
                "mitosis_events": self.dispatcher.mitosis_events}

    @property
    def recent_migrations(self) -> list[dict]:
        return list(self.dispatcher.recent_migrations)

    def views(self) -> list[InstanceView]:
        """Every instance: the driver's own knowledge, placed in the controller's topology once there is one."""
        now = time.monotonic()
        topology = self.topology()
        sent = self.controller.summary()["num_dispatched"] if self.controller is not None else {}
        return [view_of(h, topology, sent.get(h.instance_id, 0), now) for h in self.board.instances.values()]

    def topology(self) -> Topology | None:
        """The controller's topology (None while the cluster is starting)."""
        return self.controller.topology() if self.controller is not None else None

    def window_lengths(self) -> dict[int, WindowLengths]:
        return {h.instance_id: h.window_lengths for h in self.board.instances.values()}

    def cluster_timeline(self) -> ClusterTimeline:
        """GET /cluster/timeline: seconds since the frontend started."""
        return self.timeline.snapshot(time.monotonic() - self._started)

    def scale_by_hand(self, macro: int, delta: int) -> list[dict]:
        """POST /cluster/scale: a mitosis step on `macro` (ValueError when the controller cannot)."""
        if self.controller is None:
            raise ValueError("the cluster is still starting")
        acts = self.controller.scale_by_hand(macro, delta)
        self.dispatcher.apply(acts)
        return [{"kind": a.kind, "macro": a.macro, "instances": list(a.instances), "other": a.other}
                for a in acts if isinstance(a, ev.Scale)]

    def metrics_collectors(self, model_name: str, prefix: str) -> list[Any]:
        return [ClusterCollector(self, model_name, prefix)]
