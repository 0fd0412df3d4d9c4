"""POST /v1/completions in one pass: request -> prompts -> engine -> choices -> response, with echo and
integer logprobs; the engine and SSE steps are shared with chat."""
from __future__ import annotations

from typing import Any, AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from ecoserve.request import CompletionOutput, Logprobs, RequestOutput
from ecoserve.server.protocol import CompletionRequest
from ecoserve.server.serving import ChoiceDeltas, Job, Prompt, ServerState, TokenText, check_context, sse_response


async def create_completion(state: ServerState, body: CompletionRequest, raw: Request) -> Response:
    body.check(state.max_model_len)
    lora = state.check_model(body.model)
    prompts = await _prompts(state, body)
    num = body.logprobs
    structured, param = body.requested_structure()
    params = body.sampling_params(state.defaults, body.max_tokens, num, num if body.echo and num is not None else None,
                                  structured=structured)
    job = await Job.start(state, "cmpl", prompts, params, param, raw.headers, lora)
    if body.stream:
        return sse_response(job, "text_completion", _chunks(state, body, job), body.include_usage())
    finals = await job.run_to_end(raw)
    if finals is None:
        return Response(status_code=499)
    choices = [_choice(state, body, job, i, out, c, c.text, c.token_ids, c.logprobs or [], body.echo)
               for i, out in enumerate(finals) for c in out.outputs]
    return JSONResponse({"id": job.request_id, "object": "text_completion", "created": job.created,
                         "model": job.model_name, "choices": choices, "usage": job.usage()})


async def _prompts(state: ServerState, body: CompletionRequest) -> list[Prompt]:
    """Each prompt tokenized (or, given as ids and echoed, decoded) on the tokenizer pool, then checked."""
    def prepare(p: str | list[int]) -> Prompt:
        if isinstance(p, str):
            return state.encode_prompt(p, "prompt")
        if body.echo and len(p) <= state.max_model_len:
            return Prompt(None, list(p), echo_text=state.tokenizer.decode(p))
        return Prompt(None, list(p))

    for p in body.prompts():
        if isinstance(p, str):
            state.check_prompt_chars(len(p), "prompt")  # before anything is tokenized
    prompts = []
    for p in body.prompts():
        prompt = await state.off_loop(prepare, p) if isinstance(p, str) or body.echo else Prompt(None, list(p))
        check_context(prompt, body.max_tokens, state.max_model_len, "prompt")
        prompts.append(prompt)
    return prompts


async def _chunks(state: ServerState, body: CompletionRequest, job: Job) -> AsyncIterator[list[dict[str, Any]]]:
    """The choices of each streamed text_completion: what each output made showable; the prompt echoes first."""
    deltas: dict[int, ChoiceDeltas] = {}
    async for i, out in job.outputs():
        choices = []
        for c in out.outputs:
            d = deltas.setdefault(i * job.params.n + c.index, ChoiceDeltas()).take(c, force_first=body.echo)
            if d is not None:
                choices.append(_choice(state, body, job, i, out, c, d.text, d.token_ids, d.logprobs,
                                       body.echo and d.first))
        if choices:
            yield choices


def _choice(state: ServerState, body: CompletionRequest, job: Job, i: int, out: RequestOutput, c: CompletionOutput,
            text: str, token_ids: list[int], logprobs: list[Logprobs], echo: bool) -> dict[str, Any]:
    """One choice (whole or a delta) of prompt `i`; `echo` puts the prompt in front."""
    token_ids = list(token_ids)
    lps: list[Logprobs | None] = list(logprobs)
    if echo:
        prompt = job.prompts[i]
        text = (prompt.text if prompt.text is not None else prompt.echo_text or "") + text
        token_ids = out.prompt_token_ids + token_ids
        lps = list(out.prompt_logprobs or [None] * len(out.prompt_token_ids)) + lps
    choice: dict[str, Any] = {"index": i * job.params.n + c.index, "text": text, "logprobs": None,
                              "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
    if body.logprobs is not None:
        choice["logprobs"] = completion_logprobs(state.token_text, token_ids, lps)
    return choice


def completion_logprobs(token_text: TokenText, token_ids: list[int], logprobs: list[Logprobs | None]) -> dict[str, list]:
    """OpenAI's legacy shape; each position's top dict holds the top-N and the chosen token."""
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    offset = 0
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
