"""POST /v1/chat/completions: the tokenizer's chat template, streaming or not, chat-shaped logprobs."""
from __future__ import annotations

from typing import Any, AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ecoserve.request import Logprobs, RequestOutput
from ecoserve.server.protocol import ChatCompletionRequest
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
    state.check_model(body.model)
    prompt = state.encode_chat(body.messages, body.add_generation_prompt, body.continue_final_message)
    max_tokens = body.requested_max_tokens()
    check_context(len(prompt.token_ids), max_tokens, state.max_model_len, "messages")
    params = body.sampling_params(state.defaults, max_tokens, body.num_logprobs())
    job = start_job(state.engine, "chatcmpl", [prompt], params)
    if body.stream:
        return StreamingResponse(_stream(state, body, job), media_type="text/event-stream")
    try:
        finals = await run_to_end(state, raw, job)
    except ClientDisconnected:
        return Response(status_code=499)
    choices = []
    for c in finals[0].outputs:
        logprobs = None
        if body.logprobs:
            logprobs = chat_logprobs(state.token_text, c.token_ids, c.logprobs or [], body.top_logprobs or 0)
        choices.append({"index": c.index, "message": {"role": "assistant", "content": c.text},
                        "logprobs": logprobs, "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
    return JSONResponse({"id": job.request_id, "object": "chat.completion", "created": job.created,
                         "model": state.model_name, "choices": choices, "usage": usage(job.prompts, finals)})


async def _stream(state: ServerState, body: ChatCompletionRequest, job: Job) -> AsyncIterator[str]:
    head = {"id": job.request_id, "object": "chat.completion.chunk", "created": job.created,
            "model": state.model_name}
    # The role arrives first and alone, as OpenAI sends it.
    roles = [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
             for i in range(job.params.n)]
    yield sse({**head, "choices": roles})
    deltas = DeltaStreams()
    final: RequestOutput | None = None
    try:
        async for _, out in merge(job.streams):
            final = out
            choices = []
            for c in out.outputs:
                d = deltas.take(c.index, c)
                if d is None:
                    continue
                choice: dict[str, Any] = {"index": c.index, "delta": {"content": d.text} if d.text else {},
                                          "logprobs": None, "finish_reason": c.finish_reason,
                                          "stop_reason": c.stop_reason}
                if body.logprobs:
                    choice["logprobs"] = chat_logprobs(state.token_text, d.token_ids, d.logprobs,
                                                       body.top_logprobs or 0)
                choices.append(choice)
            if choices:
                yield sse({**head, "choices": choices})
        if body.stream_options is not None and body.stream_options.include_usage:
            yield sse({**head, "choices": [], "usage": usage(job.prompts, [final])})
    except Exception as e:
        yield sse_error(e)
    finally:
        abort_job(state.engine, job)
    yield "data: [DONE]\n\n"
