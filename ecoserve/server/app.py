"""The FastAPI app: OpenAI-compatible routes over an AsyncEngine, plus health, metrics and tokenizer routes."""
from __future__ import annotations

import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST

import ecoserve
from ecoserve.engine.async_engine import AsyncEngine
from ecoserve.server.auth import install_api_key
from ecoserve.server.chat import create_chat_completion
from ecoserve.server.completions import create_completion
from ecoserve.server.errors import APIError, bad_request, install_error_handlers
from ecoserve.server.metrics import ServerMetrics
from ecoserve.server.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from ecoserve.server.serving import ServerState
from ecoserve.server.tool_parsers import get_tool_parser


def create_app(engine: AsyncEngine, served_model_name: str | None = None, *, api_key: str | None = None,
               metrics_prefix: str = "ecoserve", tool_call_parser: str | None = None) -> FastAPI:
    """An app serving `engine`; the engine thread starts with the app's lifespan and stops with it.

    `api_key` guards the /v1 routes; `metrics_prefix` names the /metrics series (`vllm` for vLLM's
    dashboards); `tool_call_parser` reads tool calls out of the text for tool_choice "auto".
    """
    name = served_model_name or engine.engine.model_name
    if engine.observer is None:
        engine.observer = ServerMetrics(engine.engine, name, metrics_prefix)
    parser = get_tool_parser(tool_call_parser) if tool_call_parser else None
    state = ServerState(engine, name, engine.observer, parser)
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        yield
        await engine.stop()

    app = FastAPI(title="ecoserve", version=getattr(ecoserve, "__version__", "0"), lifespan=lifespan)
    app.state.server = state
    install_error_handlers(app)
    if api_key:
        install_api_key(app, api_key)

    @app.post("/v1/completions")
    async def completions(raw: Request) -> Response:
        return await create_completion(state, CompletionRequest.model_validate_json(await raw.body()), raw)

    @app.post("/v1/chat/completions")
    async def chat_completions(raw: Request) -> Response:
        return await create_chat_completion(state, ChatCompletionRequest.model_validate_json(await raw.body()), raw)

    def model_card() -> dict:
        return {"id": name, "object": "model", "created": created, "owned_by": "ecoserve",
                "root": str(engine.engine.loaded.path), "max_model_len": state.max_model_len}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> dict:
        state.check_model(model)
        return model_card()

    @app.get("/health")
    async def health() -> Response:
        if engine.is_running:
            return Response(status_code=200)
        reason = f"the engine loop died: {engine.dead_error!r}" if engine.dead_error else "the engine is not running"
        return APIError(503, reason, code="engine_dead").response()

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/version")
    async def version() -> dict:
        return {"version": getattr(ecoserve, "__version__", "0")}

    @app.post("/tokenize")
    async def tokenize(raw: Request) -> dict:
        body = TokenizeRequest.model_validate_json(await raw.body())
        state.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise bad_request("give exactly one of prompt or messages", param="prompt")
        if body.messages is not None:
            ids = state.encode_chat(body.messages, body.add_generation_prompt).token_ids
        else:
            ids = state.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        return {"tokens": ids, "count": len(ids), "max_model_len": state.max_model_len}

    @app.post("/detokenize")
    async def detokenize(raw: Request) -> dict:
        body = DetokenizeRequest.model_validate_json(await raw.body())
        state.check_model(body.model)
        vocab = engine.engine.loaded.spec.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise bad_request(f"tokens must be in [0, {vocab}), got {bad[:5]}", param="tokens")
        return {"prompt": state.tokenizer.decode(body.tokens)}

    return app

