"""POST /v1/chat/completions in one pass: request -> prompt -> engine -> output -> response.

The prompt is the tokenizer's chat template over the messages (and the tools, where the output may
call them); `ToolCalling` (server/tools.py) says how tool_choice constrains the output and how its
text is read back as content and tool calls; the engine and SSE steps are shared with completions.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from ecoserve.request import CompletionOutput, Logprobs, RequestOutput
from ecoserve.sampling import SamplingParams
from ecoserve.server.errors import bad_request
from ecoserve.server.protocol import ChatCompletionRequest, ChatMessage
from ecoserve.server.serving import (ChoiceDeltas, Job, Prompt, ServerState, TokenText, check_context,
                                     sse_response)
from ecoserve.server.tools import ToolCalling, ToolStream, check_tools


async def create_chat_completion(state: ServerState, body: ChatCompletionRequest, raw: Request) -> Response:
    chat = await chat_input(state, body)
    job = await Job.start(state, "chatcmpl", [chat.prompt], chat.params, chat.structured_param, raw.headers,
                          chat.lora)
    if body.stream:
        return sse_response(job, "chat.completion.chunk", _chunks(state, body, chat.calling, job),
                            body.include_usage())
    finals = await job.run_to_end(raw)
    if finals is None:
        return Response(status_code=499)
    return JSONResponse(_completion(state, body, chat.calling, job, finals[0]))


# ---- request -> prompt ------------------------------------------------------------------------------

@dataclass(frozen=True)
class ChatInput:
    """What a chat request asks of the engine, and how its output is to be read."""

    prompt: Prompt
    params: SamplingParams
    structured_param: str  # the request field a bad output constraint is blamed on
    calling: ToolCalling
    lora: Any = None  # the LoRARequest the request's `model` named


async def chat_input(state: ServerState, body: ChatCompletionRequest) -> ChatInput:
    """Check the request, then template the messages (with the tools, on the tokenizer pool) and build its
    sampling parameters."""
    body.check(state.max_model_len)
    check_tools(body.tools, body.tool_choice)
    lora = state.check_model(body.model)
    calling = ToolCalling.of(body.tools, body.tool_choice, state.tool_parser)
    structured, param = calling.constraint(body.requested_structure(), body.tools, body.tool_choice,
                                           body.parallel_tool_calls)
    state.check_prompt_chars(sum(len(m.text()) for m in body.messages), "messages")
    prompt = await state.off_loop(encode_chat, state.tokenizer, body.messages, body.add_generation_prompt,
                                  body.continue_final_message, calling.template_tools(body.tools), state)
    max_tokens = body.requested_max_tokens()
    check_context(prompt, max_tokens, state.max_model_len, "messages")
    params = body.sampling_params(state.defaults, max_tokens, body.num_logprobs(), structured=structured)
    return ChatInput(prompt, params, param, calling, lora)


def encode_chat(tokenizer: Any, messages: list[ChatMessage], add_generation_prompt: bool = True,
                continue_final_message: bool = False, tools: list[dict] | None = None,
                limit_to: ServerState | None = None) -> Prompt:
    """Apply the tokenizer's chat template (with the tools, when given); its special tokens are not added twice.

    With `limit_to`, the text is tokenized only as far as that server's context can hold. Blocking: run
    it on the tokenizer pool."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise bad_request("this model's tokenizer has no chat template; use /v1/completions", param="messages")
    conversation = [template_message(m) for m in messages]
    try:
        text = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=add_generation_prompt,
                                             continue_final_message=continue_final_message, tools=tools)
    except Exception as e:  # template errors (e.g. roles that must alternate) are the client's to fix
        raise bad_request(f"the chat template rejected the messages: {e}", param="messages") from None
    if limit_to is not None:
        return limit_to.encode_prompt(text, "messages", add_special_tokens=False)
    return Prompt(text, tokenizer.encode(text, add_special_tokens=False))


def template_message(message: ChatMessage) -> dict[str, Any]:
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


# ---- output -> response -----------------------------------------------------------------------------

def _completion(state: ServerState, body: ChatCompletionRequest, calling: ToolCalling, job: Job,
                final: RequestOutput) -> dict[str, Any]:
    """The chat.completion object of a finished job: each choice's message with its tool calls read out."""
    choices = []
    for c in final.outputs:
        logprobs = None
        if body.logprobs:
            logprobs = chat_logprobs(state.token_text, c.token_ids, c.logprobs or [], body.top_logprobs or 0)
        message, finish_reason = calling.message(c.text, c.finish_reason)
        choices.append({"index": c.index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason,
                        "stop_reason": c.stop_reason})
    return {"id": job.request_id, "object": "chat.completion", "created": job.created, "model": job.model_name,
            "choices": choices, "usage": job.usage()}


async def _chunks(state: ServerState, body: ChatCompletionRequest, calling: ToolCalling,
                  job: Job) -> AsyncIterator[list[dict[str, Any]]]:
    """The choices of each chat.completion.chunk: the role first and alone (as OpenAI sends it), then deltas."""
    n = job.params.n
    yield [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
           for i in range(n)]
    streams = [ChatChoiceStream(state.token_text, calling, body.num_logprobs()) for _ in range(n)]
    async for _, out in job.outputs():
        rounds: list[list[dict[str, Any]]] = []  # one event per round: each choice at most once in it
        for c in out.outputs:
            for k, choice in enumerate(streams[c.index].take(c)):
                if k == len(rounds):
                    rounds.append([])
                rounds[k].append(choice)
        for choices in rounds:
            yield choices


class ChatChoiceStream:
    """One choice's stream: engine deltas -> content and tool-call deltas -> the choice objects to send.

    Tokens go out with the first delta that shows their text; text the tool stream holds back (a
    possible tool call) holds its tokens too.
    """

    def __init__(self, token_text: TokenText, calling: ToolCalling, top_logprobs: int | None) -> None:
        self._token_text = token_text
        self._calling = calling
        self._top_logprobs = top_logprobs  # None: no logprobs asked
        self._deltas = ChoiceDeltas()
        self._tools = ToolStream(calling)

    def take(self, c: CompletionOutput) -> list[dict[str, Any]]:
        d = self._deltas.take(c)
        if d is None:
            return []
        pieces = self._tools.deltas(d.text, final=d.closing) or ([{}] if d.closing else [])
        if not pieces:
            self._deltas.hold(d)
            return []
        reason = self._calling.finish_reason(self._tools.finished_with_calls, c.finish_reason)
        choices = []
        for k, delta in enumerate(pieces):
            last = d.closing and k == len(pieces) - 1
            choice: dict[str, Any] = {"index": c.index, "delta": delta, "logprobs": None,
                                      "finish_reason": reason if last else None,
                                      "stop_reason": c.stop_reason if last else None}
            if self._top_logprobs is not None and k == 0:
                choice["logprobs"] = chat_logprobs(self._token_text, d.token_ids, d.logprobs, self._top_logprobs)
            choices.append(choice)
        return choices


def chat_logprobs(token_text: TokenText, token_ids: list[int], logprobs: list[Logprobs], num: int) -> dict:
    """OpenAI's chat shape: {"content": [{token, logprob, bytes, top_logprobs: [...]}, ...]}; each position's
    dict holds its top tokens and the sampled one."""
    def entry(token: int, logprob: float) -> dict[str, Any]:
        text = token_text(token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    content = []
    for token, lp in zip(token_ids, logprobs):
        item = entry(token, lp.get(token, float("-inf")))
        item["top_logprobs"] = [entry(t, v) for t, v in sorted(lp.items(), key=lambda kv: -kv[1])[:num]]
        content.append(item)
    return {"content": content}
