"""`--api-key`: every /v1 route needs `Authorization: Bearer <key>`; /health, /metrics and the rest stay open."""
from __future__ import annotations

import hmac

from fastapi import FastAPI, Request

from ecoserve.server.errors import APIError

API_KEY_ENV = "ECOSERVE_API_KEY"


def install_api_key(app: FastAPI, api_key: str) -> None:
    """Reject /v1 requests without the key with OpenAI's 401 (code invalid_api_key)."""
    expected = f"Bearer {api_key}".encode()

    @app.middleware("http")
    async def _check_key(request: Request, call_next):
        path = request.url.path
        if path == "/v1" or path.startswith("/v1/"):
            given = request.headers.get("authorization", "").encode()
            if not hmac.compare_digest(given, expected):
                message = ("missing API key: send it as the header Authorization: Bearer <key>" if not given
                           else "incorrect API key provided")
                return APIError(401, message, code="invalid_api_key",
                                headers={"WWW-Authenticate": "Bearer"}).response()
        return await call_next(request)
