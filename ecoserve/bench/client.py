"""Streaming request senders for OpenAI-compatible endpoints; one per `--backend`, registered by name.

Each sender posts one request with `stream: true`, timestamps every SSE chunk that carries text,
and returns a `RequestOutput`. Failures are recorded in the output, never raised.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Awaitable, Callable

import aiohttp

from ecoserve.bench.metrics import RequestOutput


@dataclass(frozen=True)
class RequestInput:
    api_url: str
    model: str
    prompt: str | list[int]
    prompt_len: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0


def _completions_payload(req: RequestInput) -> dict:
    return {"model": req.model, "prompt": req.prompt, "max_tokens": req.max_tokens}


def _chat_payload(req: RequestInput) -> dict:
    if not isinstance(req.prompt, str):
        raise ValueError("the openai-chat backend needs text prompts, got token ids")
    return {"model": req.model, "messages": [{"role": "user", "content": req.prompt}],
            "max_completion_tokens": req.max_tokens}


def _completions_text(choice: dict) -> str:
    return choice.get("text") or ""


def _chat_text(choice: dict) -> str:
    delta = choice.get("delta") or {}
    return delta.get("content") or delta.get("reasoning_content") or ""


async def _stream(session: aiohttp.ClientSession, req: RequestInput, payload: dict,
                  chunk_text: Callable[[dict], str]) -> RequestOutput:
    payload.update(stream=True, stream_options={"include_usage": True}, temperature=req.temperature)
    if req.ignore_eos:
        payload["ignore_eos"] = True  # vLLM-style extension; omitted otherwise so strict servers accept it
    out = RequestOutput(prompt_len=req.prompt_len)
    text: list[str] = []
    start = last = time.perf_counter()
    try:
        async with session.post(req.api_url, json=payload) as resp:
            if resp.status != 200:
                out.error = f"HTTP {resp.status}: {(await resp.text())[:500]}"
                return out
            async for raw in resp.content:  # aiohttp yields the body line by line
                line = raw.decode("utf-8").strip()
                if not line.startswith("data:"):
                    continue  # blank separators and ": comment" keep-alives
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    out.error = f"stream error: {json.dumps(chunk['error'])[:500]}"
                    return out
                piece = "".join(chunk_text(c) for c in chunk.get("choices") or [])
                if piece:
                    now = time.perf_counter()
                    if not text:
                        out.ttft = now - start
                    else:
                        out.itl.append(now - last)
                    last = now
                    text.append(piece)
                usage = chunk.get("usage")
                if usage:
                    out.output_tokens = usage.get("completion_tokens", out.output_tokens)
                    out.prompt_tokens = usage.get("prompt_tokens", out.prompt_tokens)
        out.latency = time.perf_counter() - start
        out.generated_text = "".join(text)
        out.success = bool(text) or out.output_tokens == 0
        if not out.success:
            out.error = "stream ended without any generated text"
    except Exception as e:  # connection resets, bad JSON, timeouts: count as failed, keep the run going
        out.error = f"{type(e).__name__}: {e}"
    return out


async def openai_completions(session: aiohttp.ClientSession, req: RequestInput) -> RequestOutput:
    return await _stream(session, req, _completions_payload(req), _completions_text)


async def openai_chat(session: aiohttp.ClientSession, req: RequestInput) -> RequestOutput:
    try:
        payload = _chat_payload(req)
    except ValueError as e:
        return RequestOutput(prompt_len=req.prompt_len, error=str(e))
    return await _stream(session, req, payload, _chat_text)


Sender = Callable[[aiohttp.ClientSession, RequestInput], Awaitable[RequestOutput]]
# backend -> (sender, default endpoint)
BACKENDS: dict[str, tuple[Sender, str]] = {
    "openai": (openai_completions, "/v1/completions"),
    "openai-chat": (openai_chat, "/v1/chat/completions"),
}
