"""Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}` with the right status.

A client's mistake is always a 4xx; only our own bugs are a 500.
"""
from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger(__name__)

_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "not_found_error", 405: "invalid_request_error",
          413: "invalid_request_error", 422: "invalid_request_error", 429: "rate_limit_error",
          500: "server_error", 503: "service_unavailable"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": _TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param, code)


def from_validation_error(e: ValidationError | RequestValidationError) -> APIError:
    """The first problem pydantic found, as a 400 naming the field."""
    errors = e.errors()
    if not errors:
        return bad_request("invalid request")
    first = errors[0]
    if first.get("type") == "json_invalid":
        return bad_request(f"the request body is not valid JSON: {first.get('ctx', {}).get('error', first['msg'])}",
                           code="invalid_json")
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    # A union's members show up in loc as type tags ("str", "list[int]", "TextPart"); the field ends before them.
    field_loc = []
    for part in loc:
        if not (part.isdigit() or (part.isidentifier() and part.islower() and part not in _TYPE_TAGS)):
            break
        field_loc.append(part)
    param = ".".join(field_loc) or None
    message = first.get("msg", "invalid value")
    if len(field_loc) < len(loc):
        message = "wrong type or value"
    if first.get("type") == "missing":
        message = "a required field is missing"
    elif first.get("type") == "extra_forbidden":
        message = "unknown field"
    elif "input" in first and first.get("type") not in ("model_type", "dict_type"):
        message = f"{message}, got {_short(first['input'])}"
    return bad_request(f"{param}: {message}" if param else message, param=param)


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return from_validation_error(exc).response()

    @app.exception_handler(ValidationError)
    async def _pydantic(request: Request, exc: ValidationError) -> JSONResponse:
        return from_validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        if exc.status_code == 404:
            message = f"no route {request.method} {request.url.path}"
        return APIError(exc.status_code, message, headers=getattr(exc, "headers", None)).response()

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("internal error on %s %s", request.method, request.url.path)
        return APIError(500, f"internal server error: {type(exc).__name__}").response()
