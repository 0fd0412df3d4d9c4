"""POST /v1/chat/completions: the tokenizer's chat template, streaming or not, chat-shaped logprobs."""
from __future__ import annotations

from typing import Any, AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ecoserve.request import Logprobs, RequestOutput
from ecoserve.server.errors import bad_request
from ecoserve.server.protocol import ChatCompletionRequest
from ecoserve.server.tools import ToolCalling, ToolStream, check_tools, requested_structure, tool_call_spec
from ecoserve.server.serving import (ClientDisconnected, DeltaStreams, Job, ServerState, TokenText, abort_job,
                                     check_context, merge, run_to_end, sse, sse_error, start_job, top_entries, usage)


def chat_logprobs(token_text: TokenText, token_ids: list[int], logprobs: list[Logprobs], num: int) -> dict:
    """OpenAI's chat shape: {"content": [{token, logprob, bytes, top_logprobs: [...]}, ...]}."""
    def entry(token: int, logprob: float) -> dict[str, Any]:
        text = token_text(token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    content = []
    for token, lp in zip(token_ids, logprobs):
        item = entry(token, lp.get(token, float("-inf")))
        item["top_logprobs"] = [entry(t, v) for t, v in top_entries(lp, num)]
        content.append(item)
    return {"content": content}


async def create_chat_completion(state: ServerState, body: ChatCompletionRequest, raw: Request) -> Response:
    body.check()
    check_tools(body.tools, body.tool_choice)
    state.check_model(body.model)
    calling = ToolCalling.of(body.tools, body.tool_choice, state.tool_parser)
    structured, param = requested_structure(body)
    if calling.mode in ("named", "required"):
        if structured is not None:
            raise bad_request("a structured-output constraint cannot be combined with tool_choice "
                              f"{calling.mode!r}: the tool call decides the output's shape", param="tool_choice")
        structured, param = tool_call_spec(body.tools, body.tool_choice, body.parallel_tool_calls), "tools"
    tools = [t.model_dump(exclude_none=True) for t in body.tools] if calling.mode != "text" else None
    prompt = state.encode_chat(body.messages, body.add_generation_prompt, body.continue_final_message, tools)
    max_tokens = body.requested_max_tokens()
    check_context(len(prompt.token_ids), max_tokens, state.max_model_len, "messages")
    params = body.sampling_params(state.defaults, max_tokens, body.num_logprobs(), structured=structured)
    await state.compile_structured(params, param)
    job = start_job(state.engine, "chatcmpl", [prompt], params)
    if body.stream:
        return StreamingResponse(_stream(state, body, job, calling), media_type="text/event-stream")
    try:
        finals = await run_to_end(state, raw, job)
    except ClientDisconnected:
        return Response(status_code=499)
    choices = []
    for c in finals[0].outputs:
        logprobs = None
        if body.logprobs:
            logprobs = chat_logprobs(state.token_text, c.token_ids, c.logprobs or [], body.top_logprobs or 0)
        message, finish_reason = calling.message(c.text, c.finish_reason)
        choices.append({"index": c.index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason,
                        "stop_reason": c.stop_reason})
    return JSONResponse({"id": job.request_id, "object": "chat.completion", "created": job.created,
                         "model": state.model_name, "choices": choices, "usage": usage(job.prompts, finals)})


async def _stream(state: ServerState, body: ChatCompletionRequest, job: Job,
                  calling: ToolCalling) -> AsyncIterator[str]:
    head = {"id": job.request_id, "object": "chat.completion.chunk", "created": job.created,
            "model": state.model_name}
    # The role arrives first and alone, as OpenAI sends it.
    roles = [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
             for i in range(job.params.n)]
    yield sse({**head, "choices": roles})
    tool_streams = [ToolStream(calling) for _ in range(job.params.n)]
    deltas = DeltaStreams()
    unsent_logprobs: dict[int, tuple[list[int], list[Logprobs]]] = {}  # tokens whose text a tool stream holds
    final: RequestOutput | None = None
    try:
        async for _, out in merge(job.streams):
            final = out
            rounds: list[list[dict[str, Any]]] = []  # one SSE event per round: each choice at most once in it
            for c in out.outputs:
                d = deltas.take(c.index, c)
                if d is None:
                    continue
                tools = tool_streams[c.index]
                pieces = tools.deltas(d.text, final=d.closing) or ([{}] if d.closing else [])
                token_ids, logprobs = unsent_logprobs.pop(c.index, ([], []))
                token_ids, logprobs = token_ids + d.token_ids, logprobs + d.logprobs
                if not pieces:
                    unsent_logprobs[c.index] = (token_ids, logprobs)
                    continue
                reason = c.finish_reason
                if tools.finished_with_calls and reason == "stop":
                    reason = "tool_calls"
                for k, delta in enumerate(pieces):
                    last = d.closing and k == len(pieces) - 1
                    choice: dict[str, Any] = {"index": c.index, "delta": delta, "logprobs": None,
                                              "finish_reason": reason if last else None,
                                              "stop_reason": c.stop_reason if last else None}
                    if body.logprobs and k == 0:
                        choice["logprobs"] = chat_logprobs(state.token_text, token_ids, logprobs,
                                                           body.top_logprobs or 0)
                    if k == len(rounds):
                        rounds.append([])
                    rounds[k].append(choice)
            for choices in rounds:
                yield sse({**head, "choices": choices})
        if body.stream_options is not None and body.stream_options.include_usage:
            yield sse({**head, "choices": [], "usage": usage(job.prompts, [final])})
    except Exception as e:
        yield sse_error(e)
    finally:
        abort_job(state.engine, job)
    yield "data: [DONE]\n\n"
