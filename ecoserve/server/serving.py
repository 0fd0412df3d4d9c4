"""The engine and response steps that completions and chat share.

A route turns its request into prompts and SamplingParams; `Job.start` queues them in the engine;
the route then either awaits the final outputs (`Job.run_to_end`) or turns each output into the
choices of SSE chunks, which `sse_response` frames and ends with usage, an error and `[DONE]`.
"""
from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Mapping

from fastapi import Request
from fastapi.responses import StreamingResponse

from ecoserve.engine.async_engine import (AsyncEngine, EngineDeadError, EngineOverloadedError,
                                          EngineShutdownError)
from ecoserve.request import CompletionOutput, Logprobs, RequestOutput
from ecoserve.sampling import SamplingParams
from ecoserve.server.errors import APIError, bad_request
from ecoserve.server.tool_parsers import ToolParser


TOKENIZER_THREADS = 2  # the pool that tokenizes, templates and detokenizes whole texts off the event loop
CHARS_PER_TOKEN_SLACK = 2  # a text longer than max_model_len x (longest token x this) cannot fit the context
_FALLBACK_TOKEN_CHARS = 64  # for a tokenizer that cannot list its vocabulary


@dataclass(frozen=True)
class Prompt:
    text: str | None  # None for a prompt given as token ids
    token_ids: list[int]
    truncated: bool = False  # tokenized only up to max_model_len + 1 tokens: it has at least that many
    echo_text: str | None = None  # a token-id prompt decoded (off the loop) for echo


def check_context(prompt: Prompt, max_tokens: int | None, max_model_len: int, param: str) -> None:
    prompt_len = len(prompt.token_ids)
    if prompt_len > max_model_len:
        count = f"more than {max_model_len}" if prompt.truncated else str(prompt_len)
        raise APIError(400, f"this model's maximum context length is {max_model_len} tokens, but the prompt has "
                            f"{count} tokens", param=param, code="context_length_exceeded")
    if max_tokens is not None and prompt_len + max_tokens > max_model_len:
        raise APIError(400, f"this model's maximum context length is {max_model_len} tokens, but "
                            f"{prompt_len + max_tokens} were requested ({prompt_len} in the prompt, {max_tokens} "
                            f"for the completion); reduce the prompt or max_tokens", param="max_tokens",
                       code="context_length_exceeded")


def engine_error(e: BaseException) -> APIError:
    """The HTTP error for an exception from the engine side."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, ValueError):  # the engine's checks start with the field they refuse
        field_name = str(e).split(" ", 1)[0]
        return bad_request(str(e), param=field_name if field_name in _PARAM_FIELDS else None)
    if isinstance(e, EngineOverloadedError):
        return APIError(503, str(e), code="queue_full", headers={"Retry-After": str(e.retry_after)})
    if isinstance(e, EngineShutdownError):
        return APIError(503, str(e), code="shutting_down")
    if isinstance(e, EngineDeadError):
        return APIError(503, str(e), code="engine_dead")
    return APIError(500, f"internal server error: {type(e).__name__}: {e}")


_PARAM_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))


@dataclass
class Job:
    """One HTTP request in the engine: one engine request per prompt, each with `params.n` samples."""

    state: ServerState
    request_id: str
    prompts: list[Prompt]
    params: SamplingParams
    streams: list[AsyncIterator[RequestOutput]] = field(default_factory=list)
    created: int = field(default_factory=lambda: int(time.time()))
    lora: Any = None  # the LoRARequest the request's `model` named; None for the base model
    finals: list[RequestOutput | None] = field(init=False)  # each prompt's latest output

    def __post_init__(self) -> None:
        self.finals = [None] * len(self.prompts)

    @classmethod
    async def start(cls, state: ServerState, prefix: str, prompts: list[Prompt], params: SamplingParams,
                    structured_param: str, headers: Mapping[str, str] | None = None, lora: Any = None) -> Job:
        """Compile the grammar (a bad one is a 400 naming `structured_param`), then queue every prompt or none,
        with the LoRA adapter `lora` (a LoRARequest) when the request named one.

        With tracing on, each prompt's span continues the trace of the `headers`' traceparent."""
        await state.compile_structured(params, structured_param)
        job = cls(state, f"{prefix}-{uuid.uuid4().hex}", prompts, params, lora=lora)
        adapter = {"lora_request": lora} if lora is not None else {}
        try:
            for i, p in enumerate(prompts):
                if state.tracer is not None:  # before generate: a cluster reports its routing while queueing
                    state.tracer.start(job._sub_id(i), headers, len(p.token_ids), params)
                job.streams.append(state.engine.generate(job._sub_id(i), p.token_ids, params, p.text, **adapter))
        except BaseException as e:
            job.abort()
            raise engine_error(e) from None
        if hasattr(state.metrics, "on_accepted"):
            state.metrics.on_accepted(params.max_tokens, len(prompts))
        return job

    def _sub_id(self, i: int) -> str:
        return f"{self.request_id}-{i}"

    def abort(self) -> None:
        """Abort every queued request (a no-op for those that finished)."""
        for i in range(len(self.streams)):
            self.state.engine.abort(self._sub_id(i))
        if self.state.tracer is not None:
            for i in range(len(self.prompts)):
                self.state.tracer.abort(self._sub_id(i))

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Every prompt's outputs as they come, tagged with the prompt's index."""
        async with aclosing(_merge(self.streams)) as merged:
            async for i, out in merged:
                self.finals[i] = out
                if out.finished and self.state.tracer is not None:
                    self.state.tracer.finish(self._sub_id(i), out)
                yield i, out

    async def run_to_end(self, raw: Request) -> list[RequestOutput] | None:
        """The final outputs, or None if the client left first; the job is aborted either way."""
        async def collect() -> list[RequestOutput]:
            async for _ in self.outputs():
                pass
            return self.finals  # type: ignore[return-value]

        try:
            return await _unless_disconnected(raw, collect())
        except _ClientDisconnected:
            return None
        except Exception as e:
            raise engine_error(e) from None
        finally:
            self.abort()

    @property
    def model_name(self) -> str:
        """The `model` responses name: the adapter's name, as vLLM answers, or the served model's."""
        return self.lora.lora_name if self.lora is not None else self.state.model_name

    def usage(self) -> dict[str, int]:
        prompt_tokens = sum(len(p.token_ids) for p in self.prompts)
        completion_tokens = sum(len(c.token_ids) for o in self.finals if o is not None for c in o.outputs)
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens}


async def _merge(streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of several streams as they come, tagged with the stream's index."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    q: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in stream:
                q.put_nowait((i, out))
        except Exception as e:
            q.put_nowait((i, e))
        finally:
            q.put_nowait((i, done))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await q.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()


class _ClientDisconnected(Exception):
    """The client went away before its response was ready."""


async def _wait_disconnect(raw: Request) -> None:
    while (await raw.receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected(raw: Request, work: Awaitable[Any]) -> Any:
    """Run `work` (a coroutine); if the client disconnects first, cancel it and raise _ClientDisconnected."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(raw))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        raise _ClientDisconnected()
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            try:
                await task
            except BaseException:
                pass


@dataclass(frozen=True)
class ChoiceDelta:
    """What one streamed chunk of one choice carries."""

    text: str
    token_ids: list[int]
    logprobs: list[Logprobs]
    first: bool  # the choice's first chunk
    closing: bool  # the choice's last chunk (finish_reason set)


class ChoiceDeltas:
    """One choice's engine deltas as chunks to send: tokens whose text the detokenizer still holds back
    (a possible stop string, a partial character) wait and go out with the text they make."""

    def __init__(self) -> None:
        self._token_ids: list[int] = []
        self._logprobs: list[Logprobs] = []
        self._started = False
        self._closed = False

    def take(self, c: CompletionOutput, force_first: bool = False) -> ChoiceDelta | None:
        """The chunk to send now, or None while there is nothing to show."""
        self._token_ids.extend(c.new_token_ids)
        if c.new_logprobs:
            self._logprobs.extend(c.new_logprobs)
        closing = c.finished and not self._closed
        first = not self._started
        if not (c.new_text or closing or (first and force_first)):
            return None
        delta = ChoiceDelta(c.new_text, self._token_ids, self._logprobs, first, closing)
        self._token_ids, self._logprobs, self._started = [], [], True
        self._closed = self._closed or closing
        return delta

    def hold(self, delta: ChoiceDelta) -> None:
        """The caller could not show `delta` yet (its text is held further on): its tokens go out with the next."""
        self._token_ids = delta.token_ids + self._token_ids
        self._logprobs = delta.logprobs + self._logprobs


def sse_response(job: Job, obj: str, chunks: AsyncIterator[list[dict[str, Any]]],
                 include_usage: bool) -> StreamingResponse:
    """`chunks` (each the choices of one event) as SSE, then the usage (if asked), an error, `[DONE]`."""
    head = {"id": job.request_id, "object": obj, "created": job.created, "model": job.model_name}
    return StreamingResponse(_sse_events(job, head, chunks, include_usage), media_type="text/event-stream")


async def _sse_events(job: Job, head: dict[str, Any], chunks: AsyncIterator[list[dict[str, Any]]],
                      include_usage: bool) -> AsyncIterator[str]:
    try:
        async with aclosing(chunks):
            async for choices in chunks:
                yield _sse({**head, "choices": choices})
        if include_usage:
            yield _sse({**head, "choices": [], "usage": job.usage()})
    except Exception as e:
        yield _sse(engine_error(e).body())
    finally:
        job.abort()
    yield "data: [DONE]\n\n"


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


class TokenText:
    """Token id -> its text as logprobs report it, cached per server."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._cache[token_id] = self.tokenizer.decode([token_id])
        return text


@dataclass
class ServerState:
    """What every route needs: the engine, the served name, metrics."""

    engine: AsyncEngine
    model_name: str
    metrics: Any = None
    tool_parser: ToolParser | None = None  # reads tool_choice "auto" calls (--tool-call-parser)
    use_generation_config: bool = True  # unset sampling fields take the model's generation_config.json
    tracer: Any = None  # a RequestTracer with --otlp-traces-endpoint
    loras: Any = None  # the LoRAModels registry with --enable-lora
    token_text: TokenText = field(init=False)

    pool: ThreadPoolExecutor = field(init=False)
    max_prompt_chars: int = field(init=False)  # longer texts are refused before they are tokenized

    def __post_init__(self) -> None:
        self.token_text = TokenText(self.tokenizer)
        self.pool = ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="ecoserve-tokenizer")
        self.max_prompt_chars = self.max_model_len * CHARS_PER_TOKEN_SLACK * longest_token_chars(self.tokenizer)

    @property
    def tokenizer(self) -> Any:
        return self.engine.model.tokenizer

    async def off_loop(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """`fn(*args, **kwargs)` on the tokenizer pool, so a long text never blocks the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self.pool, functools.partial(fn, *args, **kwargs))

    def check_prompt_chars(self, num_chars: int, param: str) -> None:
        """Refuse, before tokenizing, a text too long to fit the context in any tokenization."""
        if num_chars > self.max_prompt_chars:
            raise APIError(400, f"this model's maximum context length is {self.max_model_len} tokens, and the "
                                f"prompt has {num_chars} characters: more than any {self.max_model_len} tokens "
                                f"spell", param=param, code="context_length_exceeded")

    def encode_prompt(self, text: str, param: str, add_special_tokens: bool = True) -> Prompt:
        """Tokenize a prompt up to max_model_len + 1 tokens (more cannot be served); call it off the loop."""
        self.check_prompt_chars(len(text), param)
        limit = self.max_model_len + 1
        ids = self.tokenizer.encode(text, add_special_tokens=add_special_tokens, truncation=True, max_length=limit)
        return Prompt(text, ids, truncated=len(ids) >= limit)

    @property
    def max_model_len(self) -> int:
        return self.engine.model.max_model_len

    @property
    def defaults(self) -> dict[str, Any]:
        """Sampling defaults for fields a request leaves unset (before OpenAI's own defaults)."""
        return self.engine.model.generation_defaults if self.use_generation_config else {}

    async def compile_structured(self, params: SamplingParams, param: str) -> None:
        """Compile the request's grammar on the grammar thread, so a bad one is a 400 before anything starts."""
        spec = params.structured_outputs
        if spec is None:
            return
        try:
            await self.engine.check_grammar(spec)
        except ValueError as e:
            raise bad_request(str(e), param=param) from None

    def check_model(self, name: str | None) -> Any:
        """The LoRARequest of the adapter `name` names, None for the served model; 404 for any other name."""
        if name in (None, "", self.model_name):
            return None
        lora = self.loras.resolve(name) if self.loras is not None else None
        if lora is None:
            served = [self.model_name, *(self.loras.adapters if self.loras is not None else ())]
            raise APIError(404, f"the model {name!r} does not exist; this server serves "
                                f"{', '.join(repr(s) for s in served)}", param="model", code="model_not_found")
        return lora


def longest_token_chars(tokenizer: Any) -> int:
    """The most characters one token of `tokenizer` spells (its vocabulary's longest entry)."""
    if tokenizer is None:
        return _FALLBACK_TOKEN_CHARS
    try:
        vocab = tokenizer.get_vocab()
    except Exception:
        return _FALLBACK_TOKEN_CHARS
    return max((len(t) for t in vocab), default=_FALLBACK_TOKEN_CHARS)
