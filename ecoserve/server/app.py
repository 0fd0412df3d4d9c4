"""The FastAPI app: OpenAI-compatible routes over an `EngineClient`, plus health, metrics and tokenizer routes."""
from __future__ import annotations

import logging
import time
from contextlib import asynccontextmanager
from typing import Any, Sequence

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel

import ecoserve
from ecoserve.server.auth import admin_api_guard, install_api_key
from ecoserve.server.body_limit import DEFAULT_MAX_REQUEST_BODY_BYTES, BodyLimitMiddleware
from ecoserve.server.chat import create_chat_completion, encode_chat
from ecoserve.server.completions import create_completion
from ecoserve.server.engine_client import EngineClient
from ecoserve.server.errors import APIError, bad_request, install_error_handlers
from ecoserve.server.lora import LoRAModels, LoRAModulePath, lora_router
from ecoserve.server.metrics import ServerMetrics
from ecoserve.server.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from ecoserve.server.serving import ServerState
from ecoserve.server.tool_parsers import get_tool_parser

logger = logging.getLogger(__name__)


GENERATION_CONFIG_CHOICES = ("auto", "vllm")


def create_app(engine: EngineClient, served_model_name: str | None = None, generation_config: str = "auto", *,
               api_key: str | None = None, metrics_prefix: str = "ecoserve", tool_call_parser: str | None = None,
               routers: Sequence[APIRouter] = (), max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES,
               enable_admin_api: bool = False, metrics_public: bool = False,
               otlp_traces_endpoint: str | None = None, tracer_provider: Any = None, enable_lora: bool = False,
               lora_modules: Sequence[LoRAModulePath] = (), allow_runtime_lora_updating: bool = False) -> FastAPI:
    """An app serving `engine`; the engine starts with the app's lifespan and stops with it.

    generation_config "auto": sampling fields a request omits take the model's generation_config.json
    values (as vLLM's `--generation-config auto`); "vllm": they take OpenAI's defaults. `api_key`
    guards every route but /health (and /metrics when `metrics_public`); `metrics_prefix` names the
    /metrics series (`vllm` for vLLM's dashboards); `tool_call_parser` reads tool calls out of the text
    for tool_choice "auto"; `routers` add routes of the engine's own (a cluster's /cluster), those
    tagged `admin` served only with `enable_admin_api`; a body over `max_request_body_bytes` is a 413.
    `otlp_traces_endpoint` sends a span per request to that OTLP collector (`tracer_provider`, an
    OpenTelemetry TracerProvider, takes its place: tests pass one with an in-memory exporter).
    With `enable_lora` the `lora_modules` are loaded at start-up and a request's `model` may name one;
    `allow_runtime_lora_updating` adds the load/unload routes (server/lora.py).
    """
    if generation_config not in GENERATION_CONFIG_CHOICES:
        raise ValueError(f"generation_config must be one of {GENERATION_CONFIG_CHOICES}, got {generation_config!r}")
    name = served_model_name or engine.model.name
    if engine.observer is None:
        engine.observer = ServerMetrics(engine, name, metrics_prefix)
    parser = get_tool_parser(tool_call_parser) if tool_call_parser else None
    if lora_modules and not enable_lora:
        raise ValueError("--lora-modules needs --enable-lora")
    loras = LoRAModels(engine, name, enable_lora) if enable_lora else None
    state = ServerState(engine, name, engine.observer, parser, use_generation_config=generation_config == "auto",
                        tracer=_request_tracer(engine, name, otlp_traces_endpoint, tracer_provider), loras=loras)
    _log_sampling_defaults(state, generation_config)
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        try:
            for module in lora_modules:  # a bad one stops the start, naming it
                await loras.load(module.name, module.path, module.base_model_name)
            yield
        finally:
            await engine.stop()
            state.pool.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="ecoserve", version=getattr(ecoserve, "__version__", "0"), lifespan=lifespan)
    app.state.server = state
    install_error_handlers(app)
    if api_key:
        install_api_key(app, api_key, metrics_public)
    app.add_middleware(BodyLimitMiddleware, max_bytes=max_request_body_bytes)

    @app.post("/v1/completions", openapi_extra=_json_body(CompletionRequest))
    async def completions(raw: Request) -> Response:
        return await create_completion(state, CompletionRequest.parse(await raw.body()), raw)

    @app.post("/v1/chat/completions", openapi_extra=_json_body(ChatCompletionRequest))
    async def chat_completions(raw: Request) -> Response:
        return await create_chat_completion(state, ChatCompletionRequest.parse(await raw.body()), raw)

    def model_card() -> dict:
        return {"id": name, "object": "model", "created": created, "owned_by": "ecoserve",
                "root": str(engine.model.path), "max_model_len": state.max_model_len}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [model_card(), *(loras.cards(created) if loras is not None else ())]}

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> dict:
        lora = state.check_model(model)
        if lora is not None:
            return next(c for c in loras.cards(created) if c["id"] == lora.lora_name)
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

    @app.post("/tokenize", openapi_extra=_json_body(TokenizeRequest))
    async def tokenize(raw: Request) -> dict:
        body = TokenizeRequest.parse(await raw.body())
        state.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise bad_request("give exactly one of prompt or messages", param="prompt")
        if body.messages is not None:
            prompt = await state.off_loop(encode_chat, state.tokenizer, body.messages, body.add_generation_prompt)
            ids = prompt.token_ids
        else:
            ids = await state.off_loop(state.tokenizer.encode, body.prompt,
                                       add_special_tokens=body.add_special_tokens)
        return {"tokens": ids, "count": len(ids), "max_model_len": state.max_model_len}

    @app.post("/detokenize", openapi_extra=_json_body(DetokenizeRequest))
    async def detokenize(raw: Request) -> dict:
        body = DetokenizeRequest.parse(await raw.body())
        state.check_model(body.model)
        vocab = engine.model.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise bad_request(f"tokens must be in [0, {vocab}), got {bad[:5]}", param="tokens")
        return {"prompt": await state.off_loop(state.tokenizer.decode, body.tokens)}

    if loras is not None and allow_runtime_lora_updating:
        app.include_router(lora_router(loras))
    guard = admin_api_guard(enable_admin_api)
    for router in routers:
        app.include_router(router, dependencies=[Depends(guard)])
    _document_bodies(app, [CompletionRequest, ChatCompletionRequest, TokenizeRequest, DetokenizeRequest])
    return app


def _request_tracer(engine: EngineClient, name: str, endpoint: str | None, provider: Any) -> Any:
    """The RequestTracer when tracing is on (OpenTelemetry is imported only then), else None."""
    if endpoint is None and provider is None:
        return None
    from ecoserve.server.tracing import RequestTracer, otlp_tracer_provider

    tracer = RequestTracer(provider if provider is not None else otlp_tracer_provider(endpoint), name)
    if hasattr(engine, "route_listener"):  # a cluster frontend reports where it routes each request
        engine.route_listener = tracer.on_route
    logger.info("request traces go to %s", endpoint or "the given tracer provider")
    return tracer


def _json_body(model: type[BaseModel]) -> dict:
    """The OpenAPI request body of a route that parses `model` itself (to keep OpenAI-shaped errors)."""
    ref = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}}


def _document_bodies(app: FastAPI, models: list[type[BaseModel]]) -> None:
    """Add the request models (their fields, types and value ranges) to the app's /openapi.json."""
    build = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = build()
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for model in models:
                body = model.model_json_schema(ref_template="#/components/schemas/{model}")
                components.update(body.pop("$defs", {}))
                components[model.__name__] = body
        return app.openapi_schema

    app.openapi = openapi


def _log_sampling_defaults(state: ServerState, generation_config: str) -> None:
    model_defaults = state.engine.model.generation_defaults
    if state.defaults:
        logger.info("requests that omit them get the model's generation_config.json sampling defaults: %s "
                    "(--generation-config vllm turns this off)",
                    ", ".join(f"{k}={v}" for k, v in sorted(state.defaults.items())))
    elif model_defaults:
        logger.info("--generation-config %s: ignoring the model's sampling defaults (%s); requests that omit "
                    "them get OpenAI's (temperature=1.0, top_p=1.0)", generation_config,
                    ", ".join(f"{k}={v}" for k, v in sorted(model_defaults.items())))
    else:
        logger.info("the model's generation_config.json sets no sampling defaults; requests that omit them get "
                    "OpenAI's (temperature=1.0, top_p=1.0)")
