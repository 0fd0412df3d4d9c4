"""LoRA adapters served by name, as vLLM serves them: `--lora-modules`, a request's `model` field naming an
adapter, `/v1/models` listing each with its `parent`, and the runtime `load_lora_adapter` /
`unload_lora_adapter` routes (only with runtime updates allowed, and behind the API key like every route).

The registry lives in the server; the engine client only loads, drops and runs adapters. A single engine
loads an adapter when it is registered (a bad one is refused then); a cluster frontend checks it and its
instances load it on demand, when a request for it arrives.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse, Response
from pydantic import BaseModel, ConfigDict, ValidationError

from ecoserve.server.errors import APIError, bad_request, from_validation_error

if TYPE_CHECKING:
    from ecoserve.request import LoRARequest
    from ecoserve.server.engine_client import EngineClient

logger = logging.getLogger(__name__)

RUNTIME_UPDATES_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"  # vLLM's switch for the two routes; --allow-runtime-lora-updating is ours


@dataclass(frozen=True)
class LoRAModulePath:
    """One `--lora-modules` entry: the name requests send as `model`, the PEFT checkpoint folder, the base it
    was trained on (shown as the adapter's `parent`; the served model when unset)."""

    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_module(text: str) -> LoRAModulePath:
    """`NAME=PATH` or the JSON form `{"name": ..., "path": ..., "base_model_name": ...}` (an argparse type)."""
    text = text.strip()
    if text.startswith("{"):
        try:
            spec = json.loads(text)
        except json.JSONDecodeError as e:
            raise argparse.ArgumentTypeError(f"invalid JSON for --lora-modules {text!r}: {e}") from None
        unknown = sorted(set(spec) - {"name", "path", "base_model_name"}) if isinstance(spec, dict) else []
        if not isinstance(spec, dict) or unknown or not isinstance(spec.get("name"), str) \
                or not isinstance(spec.get("path"), str) or not spec["name"] or not spec["path"]:
            raise argparse.ArgumentTypeError(
                f"--lora-modules JSON needs string fields name and path (and optionally base_model_name), "
                f"got {text!r}" + (f" with unknown field(s) {unknown}" if unknown else ""))
        base = spec.get("base_model_name")
        return LoRAModulePath(spec["name"], spec["path"], str(base) if base is not None else None)
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"invalid --lora-modules entry {text!r}: expected NAME=PATH or JSON "
                                         f"{{\"name\": ..., \"path\": ..., \"base_model_name\": ...}}")
    return LoRAModulePath(name, path)


def runtime_updates_allowed(flag: bool) -> bool:
    """The flag, or vLLM's environment switch set to true."""
    return flag or os.environ.get(RUNTIME_UPDATES_ENV, "").strip().lower() in ("1", "true")


class LoadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_int_id: int | None = None  # vLLM accepts it; the name decides


class LoRAModels:
    """The adapters this server serves, by name; each gets an id of its own that is never reused."""

    def __init__(self, engine: EngineClient, base_model_name: str, enabled: bool) -> None:
        self.engine, self.base_model_name, self.enabled = engine, base_model_name, enabled
        self.adapters: dict[str, LoRARequest] = {}
        self._next_id = 1

    async def load(self, name: str, path: str, base_model_name: str | None = None) -> LoRARequest:
        """Register an adapter and have the engine load (or, a cluster, check) it; APIError 400 for a bad one."""
        from ecoserve.request import LoRARequest

        if not self.enabled:
            raise bad_request("LoRA adapters are not enabled on this server: start it with --enable-lora",
                              param="lora_name")
        if not name or not path:
            raise bad_request("both 'lora_name' and 'lora_path' must be given", param="lora_name")
        if name == self.base_model_name or name in self.adapters:
            raise bad_request(f"the lora adapter {name!r} has already been loaded", param="lora_name")
        lora = LoRARequest(name, self._next_id, path, base_model_name)
        self._next_id += 1
        try:
            await self.engine.add_lora(lora)
        except ValueError as e:  # LoRAAdapterError: a missing file, a rank or module the engine cannot take
            raise bad_request(f"cannot load lora adapter {name!r} from {path!r}: {e}", param="lora_path") from None
        if name in self.adapters:  # registered meanwhile by a concurrent call: keep the first
            raise bad_request(f"the lora adapter {name!r} has already been loaded", param="lora_name")
        self.adapters[name] = lora
        logger.info("serving lora adapter %r (id %d) from %s", name, lora.lora_int_id, path)
        return lora

    async def unload(self, name: str) -> None:
        lora = self.adapters.pop(name, None)
        if lora is None:
            raise APIError(404, f"the lora adapter {name!r} cannot be found", param="lora_name",
                           code="model_not_found")
        await self.engine.remove_lora(name)  # requests already running with it finish with it
        logger.info("unloaded lora adapter %r", name)

    def resolve(self, model: str | None) -> LoRARequest | None:
        """The adapter a request's `model` names, None for the base model (callers check the name first)."""
        return self.adapters.get(model) if model else None

    def cards(self, created: int) -> list[dict[str, Any]]:
        return [{"id": lora.lora_name, "object": "model", "created": created, "owned_by": "ecoserve",
                 "root": lora.lora_path, "parent": lora.base_model_name or self.base_model_name}
                for lora in self.adapters.values()]


def lora_router(models: LoRAModels) -> APIRouter:
    """POST /v1/load_lora_adapter and /v1/unload_lora_adapter, answering vLLM's plain-text success lines."""
    router = APIRouter()

    @router.post("/v1/load_lora_adapter")
    async def load_lora_adapter(raw: Request) -> Response:
        body = _parse(LoadLoRAAdapterRequest, await raw.body())
        await models.load(body.lora_name, body.lora_path)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @router.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(raw: Request) -> Response:
        body = _parse(UnloadLoRAAdapterRequest, await raw.body())
        await models.unload(body.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    return router


def _parse(model: type[BaseModel], body: bytes) -> Any:
    """The body as `model`; its first problem (bad JSON, a missing or unknown field) as a 400 naming the field."""
    try:
        return model.model_validate_json(body or b"{}")
    except ValidationError as e:
        raise from_validation_error(e) from None
