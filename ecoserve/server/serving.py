"""What completions and chat share: queueing a job, merging its streams, disconnects, SSE, usage."""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable

from fastapi import Request

from ecoserve.engine.async_engine import (AsyncEngine, EngineDeadError, EngineOverloadedError,
                                          EngineShutdownError)
from ecoserve.request import CompletionOutput, Logprobs, RequestOutput
from ecoserve.sampling import SamplingParams
from ecoserve.server.errors import APIError, bad_request


class ClientDisconnected(Exception):
    """The client went away before its response was ready."""


def engine_error(e: BaseException) -> APIError:
    """The HTTP error for an exception from the engine side."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, ValueError):
        return bad_request(str(e))
    if isinstance(e, EngineOverloadedError):
        return APIError(429, str(e), code="queue_full", headers={"Retry-After": str(e.retry_after)})
    if isinstance(e, EngineShutdownError):
        return APIError(503, str(e), code="shutting_down")
    if isinstance(e, EngineDeadError):
        return APIError(503, str(e), code="engine_dead")
    return APIError(500, f"internal server error: {type(e).__name__}: {e}")


@dataclass
class Prompt:
    text: str | None
    token_ids: list[int]


@dataclass
class Job:
    """One HTTP request: one engine request per prompt, each with `params.n` samples."""

    request_id: str
    prompts: list[Prompt]
    params: SamplingParams
    streams: list[AsyncIterator[RequestOutput]] = field(default_factory=list)
    created: int = field(default_factory=lambda: int(time.time()))

    def sub_id(self, i: int) -> str:
        return f"{self.request_id}-{i}"


def check_context(prompt_len: int, max_tokens: int | None, max_model_len: int, param: str) -> None:
    if prompt_len > max_model_len:
        raise APIError(400, f"this model's maximum context length is {max_model_len} tokens, but the prompt has "
                            f"{prompt_len} tokens", param=param, code="context_length_exceeded")
    if max_tokens is not None and prompt_len + max_tokens > max_model_len:
        raise APIError(400, f"this model's maximum context length is {max_model_len} tokens, but "
                            f"{prompt_len + max_tokens} were requested ({prompt_len} in the prompt, {max_tokens} "
                            f"for the completion); reduce the prompt or max_tokens", param="max_tokens",
                       code="context_length_exceeded")


def start_job(engine: AsyncEngine, prefix: str, prompts: list[Prompt], params: SamplingParams) -> Job:
    """Queue every prompt, or none: on an error the ones already queued are aborted."""
    job = Job(f"{prefix}-{uuid.uuid4().hex}", prompts, params)
    try:
        for i, p in enumerate(prompts):
            job.streams.append(engine.generate(job.sub_id(i), p.token_ids, params, p.text))
    except BaseException as e:
        for i in range(len(job.streams)):
            engine.abort(job.sub_id(i))
        raise engine_error(e) from None
    return job


def abort_job(engine: AsyncEngine, job: Job) -> None:
    for i in range(len(job.streams)):
        engine.abort(job.sub_id(i))  # a no-op for requests that finished


async def merge(streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
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


async def _wait_disconnect(raw: Request) -> None:
    while (await raw.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(raw: Request, work: Awaitable[Any]) -> Any:
    """Run `work` (a coroutine); if the client disconnects first, cancel it and raise ClientDisconnected."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(raw))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        raise ClientDisconnected()
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            try:
                await task
            except BaseException:
                pass


async def collect(job: Job) -> list[RequestOutput]:
    finals: list[RequestOutput | None] = [None] * len(job.streams)
    async for i, out in merge(job.streams):
        finals[i] = out
    return finals  # type: ignore[return-value]


async def run_to_end(state: "ServerState", raw: Request, job: Job) -> list[RequestOutput]:
    """The final outputs of a non-streaming job; ClientDisconnected if the client left (the job is aborted)."""
    try:
        return await unless_disconnected(raw, collect(job))
    except ClientDisconnected:
        raise
    except Exception as e:
        raise engine_error(e) from None
    finally:
        abort_job(state.engine, job)


@dataclass
class _Unsent:
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[Logprobs] = field(default_factory=list)
    started: bool = False
    closed: bool = False


@dataclass(frozen=True)
class ChoiceDelta:
    """What one streamed chunk of one choice carries."""

    text: str
    token_ids: list[int]
    logprobs: list[Logprobs]
    first: bool  # the choice's first chunk
    closing: bool  # the choice's last chunk (finish_reason set)


class DeltaStreams:
    """Turns engine deltas into SSE chunks per choice: tokens whose text the detokenizer still holds
    back (a possible stop string, a partial character) wait and go out with the text they make."""

    def __init__(self) -> None:
        self._choices: dict[int, _Unsent] = {}

    def take(self, index: int, c: CompletionOutput, force_first: bool = False) -> ChoiceDelta | None:
        """The chunk to send for choice `index` now, or None while there is nothing to show."""
        st = self._choices.setdefault(index, _Unsent())
        st.token_ids.extend(c.new_token_ids)
        if c.new_logprobs:
            st.logprobs.extend(c.new_logprobs)
        closing = c.finished and not st.closed
        first = not st.started
        if not (c.new_text or closing or (first and force_first)):
            return None
        delta = ChoiceDelta(c.new_text, st.token_ids, st.logprobs, first, closing)
        st.token_ids, st.logprobs, st.started, st.closed = [], [], True, st.closed or closing
        return delta


def usage(prompts: list[Prompt], outputs: list[RequestOutput | None]) -> dict[str, int]:
    prompt_tokens = sum(len(p.token_ids) for p in prompts)
    completion_tokens = sum(len(c.token_ids) for o in outputs if o is not None for c in o.outputs)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def sse(payload: dict | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)}\n\n"


def sse_error(e: BaseException) -> str:
    return sse(engine_error(e).body())


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


def top_entries(logprobs: dict[int, float], num: int) -> list[tuple[int, float]]:
    """The `num` most likely tokens of one position (the sampled one is added to the dict by the engine)."""
    return sorted(logprobs.items(), key=lambda kv: -kv[1])[:num]


@dataclass
class ServerState:
    """What every route needs: the engine, the served name, metrics."""

    engine: AsyncEngine
    model_name: str
    metrics: Any = None
    tool_parser: Any = None  # a ToolParser for tool_choice "auto" (--tool-call-parser), or None
    use_generation_config: bool = True  # unset sampling fields take the model's generation_config.json
    token_text: TokenText = field(init=False)

    def __post_init__(self) -> None:
        self.token_text = TokenText(self.tokenizer)

    @property
    def tokenizer(self) -> Any:
        return self.engine.model.tokenizer

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

    def check_model(self, name: str | None) -> None:
        if name not in (None, "", self.model_name):
            raise APIError(404, f"the model {name!r} does not exist; this server serves {self.model_name!r}",
                           param="model", code="model_not_found")

    def encode_chat(self, messages: list[Any], add_generation_prompt: bool = True,
                    continue_final_message: bool = False, tools: list[dict] | None = None) -> Prompt:
        """Apply the tokenizer's chat template (with the tools, when given); its special tokens are not added twice."""
        tok = self.tokenizer
        if tok is None or not getattr(tok, "chat_template", None):
            raise bad_request("this model's tokenizer has no chat template; use /v1/completions", param="messages")
        conversation = [template_message(m) for m in messages]
        try:
            text = tok.apply_chat_template(conversation, tokenize=False, add_generation_prompt=add_generation_prompt,
                                           continue_final_message=continue_final_message, tools=tools)
        except Exception as e:  # template errors (e.g. roles that must alternate) are the client's to fix
            raise bad_request(f"the chat template rejected the messages: {e}", param="messages") from None
        return Prompt(text, tok.encode(text, add_special_tokens=False))


def template_message(message: Any) -> dict[str, Any]:
    """One chat message as templates expect it: tool-call arguments as objects, tool results with their call id."""
    out: dict[str, Any] = {"role": "system" if message.role == "developer" else message.role,
                           "content": message.text()}
    if message.name is not None:
        out["name"] = message.name
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    if message.tool_calls:
        calls = []
        for call in message.tool_calls:
            call = dict(call)
            function = dict(call.get("function") or {})
            if isinstance(function.get("arguments"), str):
                try:
                    function["arguments"] = json.loads(function["arguments"])
                except json.JSONDecodeError:
                    raise bad_request(f"tool call {call.get('id')!r}: arguments are not valid JSON",
                                      param="messages") from None
            call["function"] = function
            calls.append(call)
        out["tool_calls"] = calls
    return out
