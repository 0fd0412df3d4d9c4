"""`ecoserve serve`: the OpenAI-compatible server on uvicorn, with a graceful SIGINT/SIGTERM shutdown."""
from __future__ import annotations

import argparse
import logging
import os
from typing import TYPE_CHECKING, Any, Sequence

import uvicorn

from ecoserve.config import EngineArgs
from ecoserve.server.auth import API_KEY_ENV
from ecoserve.server.body_limit import DEFAULT_MAX_REQUEST_BODY_BYTES
from ecoserve.server.lora import RUNTIME_UPDATES_ENV, parse_lora_module, runtime_updates_allowed
from ecoserve.server.tool_parsers import TOOL_PARSERS

if TYPE_CHECKING:  # importing the engine pulls in torch: not for `ecoserve instance --mock-profile`
    from fastapi import APIRouter

    from ecoserve.server.engine_client import EngineClient

logger = logging.getLogger(__name__)


class GracefulServer(uvicorn.Server):
    """On the first SIGINT/SIGTERM: refuse new requests, give running ones `grace_s` seconds, then fail them."""

    def __init__(self, config: uvicorn.Config, engine: EngineClient, grace_s: float, banner: str = "") -> None:
        super().__init__(config)
        self.engine, self.grace_s, self.banner = engine, grace_s, banner

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started and self.banner:
            print(self.banner, flush=True)

    def handle_exit(self, sig: int, frame: Any) -> None:
        if not self.should_exit:
            self.engine.begin_shutdown(self.grace_s)
        super().handle_exit(sig, frame)


def curl_example(host: str, port: int, model: str) -> str:
    body = ('{"model": "%s", "messages": [{"role": "user", "content": "What is the capital of France?"}], '
            '"max_tokens": 48}' % model)
    return (f"ecoserve: serving {model} on http://{host}:{port} (Ctrl-C to stop). Try:\n"
            f"  curl http://{host}:{port}/v1/chat/completions -H 'Content-Type: application/json' -d '{body}'")


def run_server(args: argparse.Namespace, engine: EngineClient, routers: Sequence[APIRouter] = ()) -> int:
    """Serve `engine` (the one `ecoserve serve` built from `args`) until SIGINT/SIGTERM."""
    from ecoserve.server.app import create_app

    name = args.served_model_name or engine.model.name
    app = create_app(engine, name, args.generation_config, api_key=args.api_key or os.environ.get(API_KEY_ENV) or None,
                     metrics_prefix=args.metrics_prefix, tool_call_parser=args.tool_call_parser, routers=routers,
                     max_request_body_bytes=args.max_request_body_bytes, enable_admin_api=args.enable_admin_api,
                     metrics_public=args.metrics_public, otlp_traces_endpoint=getattr(args, "otlp_traces_endpoint", None),
                     enable_lora=getattr(args, "enable_lora", False), lora_modules=args.lora_modules or (),
                     allow_runtime_lora_updating=runtime_updates_allowed(args.allow_runtime_lora_updating))
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
                            access_log=False, timeout_graceful_shutdown=int(args.shutdown_timeout) + 5)
    GracefulServer(config, engine, args.shutdown_timeout, curl_example(args.host, args.port, name)).run()
    return 0


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """The `serve` command's engine and server flags; the caller adds the rest and what it runs."""
    p = subparsers.add_parser("serve", help="OpenAI-compatible HTTP server",
                              description="Serve a model over the OpenAI API (completions, chat, streaming), "
                                          "with /health, /metrics, /tokenize and /detokenize.")
    EngineArgs.add_cli_args(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default=None, help="the name clients send as `model` "
                   "(default: the --model argument, or SmolLM2-135M-Instruct)")
    p.add_argument("--generation-config", default="auto", choices=["auto", "vllm"],
                   help="auto: sampling fields a request omits take the model's generation_config.json values "
                        "(the embedded model's: temperature 0.2, top_p 0.9); vllm: OpenAI's defaults "
                        "(temperature 1.0, top_p 1.0). Default: %(default)s")
    p.add_argument("--shutdown-timeout", type=float, default=10.0,
                   help="seconds in-flight requests get to finish after SIGINT/SIGTERM before they get an error")
    p.add_argument("--api-key", default=None, help=f"require `Authorization: Bearer <key>` on every route but "
                   f"/health: /v1, /tokenize, /detokenize, /version, /cluster, /metrics (unless --metrics-public) "
                   f"(default: ${API_KEY_ENV} if set)")
    p.add_argument("--metrics-public", action="store_true",
                   help="serve /metrics without the API key (for a scraper that cannot send it)")
    p.add_argument("--enable-admin-api", action="store_true",
                   help="serve the admin routes (POST /cluster/scale drains and adds instances); off by default, "
                        "and with --api-key they need the key too")
    p.add_argument("--max-request-body-bytes", type=_positive_int, default=DEFAULT_MAX_REQUEST_BODY_BYTES,
                   help="refuse a request body larger than this with 413, before it is read (default: %(default)s, "
                        "8 MiB)")
    p.add_argument("--metrics-prefix", default="ecoserve", help="prefix of the /metrics series; `vllm` lets "
                   "vLLM's Grafana dashboards and alerts read them unchanged")
    p.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_PARSERS),
                   help="how tool calls are read out of the model's text for tool_choice 'auto'")
    p.add_argument("--otlp-traces-endpoint", default=None, metavar="URL",
                   help="send an OpenTelemetry span per request (vLLM's llm_request, with gen_ai.* attributes and "
                        "the cluster's routing) to this OTLP collector, e.g. http://localhost:4317; gRPC unless "
                        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf; needs `pip install ecoserve[otel]`")
    p.add_argument("--lora-modules", nargs="+", type=parse_lora_module, default=None, metavar="NAME=PATH",
                   help="LoRA adapters (PEFT checkpoint folders) served under NAME, which requests send as `model`; "
                        "also the JSON form '{\"name\": ..., \"path\": ..., \"base_model_name\": ...}'; "
                        "needs --enable-lora")
    p.add_argument("--allow-runtime-lora-updating", action="store_true",
                   help=f"serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (behind --api-key); also "
                        f"on with {RUNTIME_UPDATES_ENV}=True, as in vLLM")
    p.add_argument("--uvicorn-log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug", "trace"])
    return p
