"""AsyncEngine: the synchronous LLMEngine stepped by a background thread, streamed to asyncio.

Adds and aborts travel to the engine thread through a queue and are applied between steps, so
the engine itself stays single-threaded. Each request's outputs reach its consumer on the event
loop through `loop.call_soon_threadsafe`; outputs carry deltas, so every one is queued for the
consumer. However a stream ends before its request finishes (closed, its consumer gone, or never
started and dropped) the request is aborted and forgotten.

It is the server's `EngineClient` (server/engine_client.py) for one in-process engine; `ModelFacts`,
the engine errors and the step observer are what every such client shares with the server.
"""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import queue
import threading
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping, Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ecoserve.engine.guided import compile_error
from ecoserve.engine.llm_engine import LLMEngine
from ecoserve.request import RequestOutput
from ecoserve.sampling import SamplingParams
from ecoserve.structured import StructuredOutputsParams

if TYPE_CHECKING:
    from ecoserve.engine.guided import GrammarCompiler
    from ecoserve.model.loader import LoadedModel
    from ecoserve.request import LoRARequest

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine loop stopped on an exception; no request can be served any more."""


class EngineShutdownError(RuntimeError):
    """The server is shutting down and no longer serves this request."""


class EngineOverloadedError(RuntimeError):
    """The waiting queue is at its limit; retry after `retry_after` seconds."""

    def __init__(self, message: str, retry_after: int = 1) -> None:
        super().__init__(message)
        self.retry_after = retry_after


@dataclass(frozen=True)
class ModelFacts:
    """What a client of an engine reads about the model it serves (no weights)."""

    name: str  # as the user named it: the default served model name
    path: Path  # where its files are
    tokenizer: Any  # None for a model served without one
    vocab_size: int
    eos_token_ids: frozenset[int]
    max_model_len: int
    generation_defaults: Mapping[str, Any]  # the sampling fields of its generation_config.json

    @classmethod
    def of(cls, loaded: "LoadedModel", max_model_len: int) -> "ModelFacts":
        return cls(loaded.name, loaded.path, loaded.tokenizer, loaded.spec.vocab_size, loaded.eos_token_ids,
                   max_model_len, dict(loaded.generation_defaults))


async def check_grammar(compiler: "GrammarCompiler | None", spec: StructuredOutputsParams,
                        timeout_s: float | None = None) -> None:
    """Compile `spec` on the grammar threads; ValueError for a bad grammar, one that does not compile within
    `timeout_s`, or a model without a tokenizer."""
    if compiler is None:
        raise ValueError("structured outputs need a tokenizer, and this server has none")
    future = compiler.submit(spec)
    try:  # shielded: the compilation stays cached for the requests that share it
        await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(future)), timeout_s)
    except asyncio.TimeoutError:
        raise ValueError(f"the structured output grammar ({spec.kind}) did not compile within {timeout_s:g} s; "
                         f"simplify it (the limit is --grammar-compile-timeout)") from None
    except Exception:
        raise compile_error(future) from None


class StepObserver(Protocol):
    """Called on the engine thread: after each step with its outputs, and with the ids of aborted requests."""

    def on_step(self, outputs: list[RequestOutput]) -> None: ...

    def on_abort(self, request_ids: list[str]) -> None: ...


class _Stream:
    """The outputs (or an error) of one request, handed from the engine thread to one consumer, in order."""

    def __init__(self) -> None:
        self.outputs: collections.deque[RequestOutput] = collections.deque()
        self.error: BaseException | None = None
        self.finished = False  # the consumer has taken the final output
        self.event = asyncio.Event()

    def put(self, output: RequestOutput) -> None:
        self.outputs.append(output)
        self.event.set()

    def fail(self, error: BaseException) -> None:
        self.error = error
        self.event.set()


class RequestStream:
    """Async iterator over one request's outputs; the last one has `finished` set.

    Ending it early in any way (`aclose()`, or dropping it, started or not) aborts the request.
    """

    def __init__(self, engine: "AsyncEngine", request_id: str, stream: _Stream) -> None:
        self._stream = stream
        self._release = weakref.finalize(self, engine._forget, request_id, stream)

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        stream = self._stream
        if stream.finished:
            raise StopAsyncIteration
        while not stream.outputs:
            if stream.error is not None:
                self._release()
                raise stream.error
            await stream.event.wait()
            stream.event.clear()
        output = stream.outputs.popleft()
        if output.finished:
            stream.finished = True
            self._release()
        return output

    async def aclose(self) -> None:
        self._release()


_STOP = ("stop",)
_WAKE = ("wake",)  # a grammar is ready: step now
_STUCK_POLL_S = 0.001  # how often an engine that could schedule nothing looks again
_IDLE_CHECK_S = 0.5  # how often an idle engine checks its executor (a parallel instance's ranks)


class AsyncEngine:
    """The in-process engine as the server's `EngineClient`."""

    def __init__(self, engine: LLMEngine, max_waiting: int | None = None,
                 observer: StepObserver | None = None) -> None:
        self.engine = engine
        self.model = ModelFacts.of(engine.loaded, engine.max_model_len)
        self.max_waiting = engine.config.scheduler.max_waiting if max_waiting is None else max_waiting
        self.observer = observer
        self._commands: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        # adds queued but not yet applied: each counter has one writer (the loop thread, the engine thread)
        self._adds_queued = 0
        self._adds_applied = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._accepting = True
        self.dead_error: BaseException | None = None
        engine.on_grammar_ready = self._wake

    # ---- lifecycle -----------------------------------------------------------------------
    def start(self) -> None:
        """Start the engine thread; call from the event loop that will consume the streams."""
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="ecoserve-engine", daemon=True)
        self._thread.start()

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.dead_error is None

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    def begin_shutdown(self, grace_s: float) -> None:
        """Refuse new requests; those still running after `grace_s` seconds get an error.

        Safe from any thread (a signal handler); a no-op before `start`."""
        if self._loop is not None:
            self._call_soon(self._begin_shutdown, grace_s)

    def _begin_shutdown(self, grace_s: float) -> None:
        if not self._accepting:
            return
        self._accepting = False
        logger.info("shutting down: %d request(s) in flight get %.1f s to finish", len(self._streams), grace_s)
        assert self._loop is not None
        self._loop.call_later(grace_s, self._fail_all, EngineShutdownError("the server is shutting down"))

    async def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the engine thread; requests still streaming get EngineShutdownError."""
        self._accepting = False
        self._fail_all(EngineShutdownError("the server is shutting down"))
        if self._thread is None:
            return
        self._commands.put(_STOP)
        await asyncio.get_running_loop().run_in_executor(None, self._thread.join, timeout_s)
        if self._thread.is_alive():
            logger.warning("the engine thread did not stop within %.1f s; leaving it (daemon)", timeout_s)

    # ---- requests ------------------------------------------------------------------------
    def num_waiting(self) -> int:
        """Requests queued but not yet running: the scheduler's waiting queue plus adds not yet applied."""
        sched = self.engine.scheduler
        return len(sched.waiting) + len(sched.waiting_for_grammar) + self._adds_queued - self._adds_applied

    def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 prompt: str | None = None, arrival_time: float | None = None,
                 lora_request: LoRARequest | None = None) -> RequestStream:
        """Queue a request (through the adapter `lora_request`, when given) and return its stream of delta
        outputs, the last one with `finished` set.

        Raises at once (nothing queued) on a bad prompt (ValueError), a dead engine, shutdown or a
        full waiting queue. Closing the stream early aborts the request.
        """
        if self.dead_error is not None:
            raise EngineDeadError(f"the engine loop died: {self.dead_error!r}")
        if not self._accepting or self._thread is None:
            raise EngineShutdownError("the server is shutting down" if self._thread else "the engine is not started")
        if self.max_waiting is not None and self.num_waiting() >= self.max_waiting:
            raise EngineOverloadedError(f"the waiting queue is full ({self.max_waiting} requests); retry later")
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        self.engine.validate_prompt(prompt_token_ids)
        arrival = self.engine.clock.now() if arrival_time is None else arrival_time
        params = self.engine.validate_params(params)
        stream = _Stream()
        self._streams[request_id] = stream
        self._adds_queued += 1
        command = ("add", request_id, {"prompt": prompt, "prompt_token_ids": prompt_token_ids}, params, arrival,
                   lora_request)
        self._commands.put(command)  # a grammar compiles on the grammar threads while the request waits unscheduled
        return RequestStream(self, request_id, stream)

    def _forget(self, request_id: str, stream: _Stream) -> None:
        """A stream ended (its consumer may be gone): drop its entry and abort the request unless it finished.

        Runs once per stream, possibly from the garbage collector on any thread: it only touches
        the dict (atomic under the GIL) and the thread-safe command queue.
        """
        if self._streams.get(request_id) is stream:
            self._streams.pop(request_id, None)
        if not stream.finished:
            self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))

    async def check_grammar(self, spec: StructuredOutputsParams) -> None:
        """A bad grammar is a ValueError here, before any request starts."""
        guided = self.engine.guided
        await check_grammar(guided.compiler if guided is not None else None, spec, self.engine.grammar_compile_timeout_s)

    def metrics_collectors(self, model_name: str, prefix: str) -> list[Any]:
        return [SchedulerCollector(self.engine, model_name, prefix)]

    # ---- LoRA adapters -------------------------------------------------------------------
    async def add_lora(self, lora: LoRARequest) -> None:
        """Load an adapter on the engine thread, between steps; LoRAAdapterError (a ValueError) for a bad one."""
        await self._on_engine_thread(self.engine.add_lora, lora)

    async def remove_lora(self, lora_name: str) -> bool:
        return await self._on_engine_thread(self.engine.remove_lora, lora_name)

    def lora_stats(self) -> Any:
        return self.engine.lora_stats() if self.engine.config.lora is not None else None

    async def _on_engine_thread(self, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(*args)` on the engine thread (the engine is single-threaded), its result or error here."""
        if self.dead_error is not None:
            raise EngineDeadError(f"the engine loop died: {self.dead_error!r}")
        if self._thread is None:
            raise EngineShutdownError("the engine is not started")
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put(("call", fn, args, future))
        return await asyncio.wrap_future(future)

    # ---- the loop side -------------------------------------------------------------------
    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is not None:
                stream.put(output)

    def _fail(self, request_id: str, error: BaseException) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.fail(error)

    def _fail_all(self, error: BaseException) -> None:
        for stream in list(self._streams.values()):
            if stream.error is None:
                stream.fail(error)

    def _call_soon(self, fn, *args) -> None:
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop closed under us during interpreter shutdown
            pass

    # ---- the engine thread ---------------------------------------------------------------
    def _apply(self, command: tuple[Any, ...]) -> None:
        kind, request_id = command[0], command[1]
        if kind == "call":
            fn, args, future = command[1:]
            try:
                future.set_result(fn(*args))
            except Exception as e:  # the caller's error (a bad adapter), not the loop's
                future.set_exception(e)
        elif kind == "add":
            self._adds_applied += 1
            if request_id not in self._streams:
                return  # its consumer left before the add arrived (e.g. while its grammar compiled)
            try:
                lora = {"lora_request": command[5]} if command[5] is not None else {}
                self.engine.add_request(request_id, command[2], command[3], arrival_time=command[4], **lora)
            except Exception as e:  # a bad request must not take the loop down
                self._call_soon(self._fail, request_id, e)
        elif kind == "abort":
            try:
                aborted = self.engine.abort_request(request_id)
            except Exception:  # one request's abort must not take the loop down
                logger.exception("aborting request %s failed", request_id)
                return
            if aborted:
                self._observe("on_abort", aborted)

    def _wake(self) -> None:
        """A grammar finished compiling (on the grammar thread): the engine loop steps again now."""
        self._commands.put(_WAKE)

    def _observe(self, method: str, arg: list) -> None:
        if self.observer is None:
            return
        try:
            getattr(self.observer, method)(arg)
        except Exception:  # metrics must never take the engine loop down
            logger.exception("step observer %s failed", method)

    def _run(self) -> None:
        engine = self.engine
        try:
            while True:
                # Block for work only when idle (or stuck: the last step could schedule nothing, and
                # only a command can change that); otherwise take what has arrived and step.
                commands = []
                while not commands and not engine.has_unfinished_requests():
                    try:
                        commands.append(self._commands.get(timeout=_IDLE_CHECK_S))
                    except queue.Empty:
                        engine.check()  # a rank that died while idle kills the loop now, not at the next request
                if not commands and engine.last_step_empty:
                    # only requests waiting for grammars: sleep until one is compiled (its callback wakes us) or
                    # the earliest compile deadline, not a poll
                    grammar_wait = engine.grammar_wait_s()
                    try:
                        commands.append(self._commands.get(
                            timeout=_STUCK_POLL_S if grammar_wait is None else min(grammar_wait, _IDLE_CHECK_S)))
                    except queue.Empty:
                        pass
                while True:
                    try:
                        commands.append(self._commands.get_nowait())
                    except queue.Empty:
                        break
                for command in commands:
                    if command is _STOP:
                        return
                    if command is not _WAKE:
                        self._apply(command)
                if not engine.has_unfinished_requests():
                    continue
                outputs = engine.step()  # raises only for the whole batch (a failed forward): the loop dies
                self._observe("on_step", outputs)
                if outputs:
                    self._call_soon(self._deliver, outputs)
                failed = engine.take_failed()  # requests a step failed alone: their streams get the error
                if failed:
                    self._observe("on_abort", list(failed))
                    for request_id, error in failed.items():
                        self._call_soon(self._fail, request_id, error)
        except BaseException as e:
            logger.exception("the engine loop died")
            self.dead_error = e
            self._call_soon(self._fail_all, EngineDeadError(f"the engine loop died: {e!r}"))


class SchedulerCollector:
    """/metrics gauges and monotonic counters the engine already keeps, read at scrape time."""

    def __init__(self, engine: LLMEngine, model_name: str, prefix: str) -> None:
        self.engine, self.model_name, self.prefix = engine, model_name, prefix

    def collect(self):
        sched, kv, stats = self.engine.scheduler, self.engine.scheduler.kv, self.engine.stats
        label = [self.model_name]
        for name, doc, value in (
                ("num_requests_running", "Requests in the running batch.", len(sched.running)),
                ("num_requests_waiting", "Requests waiting to be scheduled (also for their grammar).",
                 len(sched.waiting) + len(sched.waiting_for_grammar)),
                ("kv_cache_usage_perc", "Fraction of KV cache blocks in use (0-1).", kv.usage),
                ("gpu_cache_usage_perc", "Deprecated alias of kv_cache_usage_perc, which vLLM's dashboard reads.",
                 kv.usage)):
            g = GaugeMetricFamily(self.prefix + name, doc, labels=["model_name"])
            g.add_metric(label, value)
            yield g
        for name, doc, value in (
                ("prompt_tokens", "Prompt tokens of accepted requests.", stats["prompt_tokens"]),
                ("generation_tokens", "Generated tokens.", stats["generation_tokens"]),
                ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", kv.prefix_queries),
                ("prefix_cache_hits", "Prompt tokens found in the prefix cache.", kv.prefix_hits),
                ("num_preemptions", "Preemptions (by recompute).", sched.num_preemptions_total)):
            c = CounterMetricFamily(self.prefix + name, doc, labels=["model_name"])
            c.add_metric(label, value)
            yield c
        if self.engine.speculator is not None:
            yield from self._spec_decode(self.engine.speculator.counters, label)

    def _spec_decode(self, counters, label):
        """vLLM's speculative decoding counters."""
        for name, doc, value in (
                ("spec_decode_num_drafts", "Decode steps that verified proposals.", counters.num_drafts),
                ("spec_decode_num_draft_tokens", "Proposed tokens verified.", counters.num_draft_tokens),
                ("spec_decode_num_accepted_tokens", "Proposed tokens accepted.", counters.num_accepted_tokens)):
            c = CounterMetricFamily(self.prefix + name, doc, labels=["model_name"])
            c.add_metric(label, value)
            yield c
        c = CounterMetricFamily(self.prefix + "spec_decode_num_accepted_tokens_per_pos",
                                "Proposed tokens accepted, by position in the proposal.",
                                labels=["model_name", "position"])
        for position, value in enumerate(counters.accepted_per_pos):
            c.add_metric(label + [str(position)], value)
        yield c
