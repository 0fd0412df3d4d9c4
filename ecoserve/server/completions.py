"""POST /v1/completions: legacy completions, streaming or not, with echo and integer logprobs."""
from __future__ import annotations

from typing import Any, AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ecoserve.request import Logprobs, RequestOutput
from ecoserve.server.protocol import CompletionRequest
from ecoserve.server.tools import requested_structure
from ecoserve.server.serving import (ClientDisconnected, DeltaStreams, Job, Prompt, ServerState, TokenText, abort_job,
                                     check_context, merge, run_to_end, sse, sse_error, start_job, usage)


def completion_logprobs(token_text: TokenText, token_ids: list[int], logprobs: list[Logprobs | None],
                        offset: int = 0) -> dict[str, list]:
    """OpenAI's legacy shape; each position's top dict holds the top-N and the chosen token."""
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token, lp in zip(token_ids, logprobs):
        text = token_text(token)
        out["tokens"].append(text)
        out["text_offset"].append(offset)
        offset += len(text)
        if lp is None:  # the first prompt token has no logprob
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
        else:
            out["token_logprobs"].append(lp.get(token))
            top: dict[str, float] = {}
            for t, v in sorted(lp.items(), key=lambda kv: -kv[1]):
                top.setdefault(token_text(t), v)  # tokens that decode alike keep the likelier one
            out["top_logprobs"].append(top)
    return out


def _prompts(state: ServerState, body: CompletionRequest) -> list[Prompt]:
    prompts = []
    for p in body.prompts():
        if isinstance(p, str):
            prompt = Prompt(p, state.tokenizer.encode(p))
        else:
            prompt = Prompt(None, list(p))
        check_context(len(prompt.token_ids), body.max_tokens, state.max_model_len, "prompt")
        prompts.append(prompt)
    return prompts


async def create_completion(state: ServerState, body: CompletionRequest, raw: Request) -> Response:
    body.check()
    state.check_model(body.model)
    prompts = _prompts(state, body)
    num = body.logprobs
    structured, param = requested_structure(body)
    params = body.sampling_params(state.defaults, body.max_tokens, num, num if body.echo and num is not None else None,
                                  structured=structured)
    await state.compile_structured(params, param)
    job = start_job(state.engine, "cmpl", prompts, params)
    if body.stream:
        return StreamingResponse(_stream(state, body, job), media_type="text/event-stream")
    try:
        finals = await run_to_end(state, raw, job)
    except ClientDisconnected:
        return Response(status_code=499)
    choices = []
    for i, out in enumerate(finals):
        for c in out.outputs:
            choice = {"index": i * params.n + c.index, "text": c.text, "logprobs": None,
                      "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
            tokens, lps = list(c.token_ids), list(c.logprobs or [])
            if body.echo:
                choice["text"] = _prompt_text(state, prompts[i]) + c.text
                tokens = out.prompt_token_ids + tokens
                lps = list(out.prompt_logprobs or [None] * len(out.prompt_token_ids)) + lps
            if num is not None:
                choice["logprobs"] = completion_logprobs(state.token_text, tokens, lps)
            choices.append(choice)
    return JSONResponse({"id": job.request_id, "object": "text_completion", "created": job.created,
                         "model": state.model_name, "choices": choices, "usage": usage(prompts, finals)})


def _prompt_text(state: ServerState, prompt: Prompt) -> str:
    return prompt.text if prompt.text is not None else state.tokenizer.decode(prompt.token_ids)


async def _stream(state: ServerState, body: CompletionRequest, job: Job) -> AsyncIterator[str]:
    n = job.params.n
    deltas = DeltaStreams()
    finals: list[RequestOutput | None] = [None] * len(job.prompts)
    head = {"id": job.request_id, "object": "text_completion", "created": job.created, "model": state.model_name}
    try:
        async for i, out in merge(job.streams):
            finals[i] = out
            choices = []
            for c in out.outputs:
                idx = i * n + c.index
                d = deltas.take(idx, c, force_first=body.echo)
                if d is None:
                    continue
                text, tokens, lps = d.text, d.token_ids, d.logprobs
                if d.first and body.echo:
                    text = _prompt_text(state, job.prompts[i]) + text
                    tokens = out.prompt_token_ids + tokens
                    lps = list(out.prompt_logprobs or [None] * len(out.prompt_token_ids)) + lps
                choice: dict[str, Any] = {"index": idx, "text": text, "logprobs": None,
                                          "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
                if body.logprobs is not None:
                    choice["logprobs"] = completion_logprobs(state.token_text, tokens, lps)
                choices.append(choice)
            if choices:
                yield sse({**head, "choices": choices})
        if body.stream_options is not None and body.stream_options.include_usage:
            yield sse({**head, "choices": [], "usage": usage(job.prompts, finals)})
    except Exception as e:
        yield sse_error(e)
    finally:
        abort_job(state.engine, job)
    yield "data: [DONE]\n\n"
