"""`--api-key`: every route but /health (and /metrics with `--metrics-public`) needs `Authorization: Bearer
<key>`; routes tagged `admin` (the cluster's /cluster/scale) also need `--enable-admin-api`."""
from __future__ import annotations

import hmac

from fastapi import FastAPI, Request

from ecoserve.server.errors import APIError

API_KEY_ENV = "ECOSERVE_API_KEY"
ADMIN_TAG = "admin"  # routes with this tag change the deployment: they are off unless --enable-admin-api


def open_paths(metrics_public: bool) -> frozenset[str]:
    """The paths anyone may reach when a key is set: the health probe, and /metrics if made public."""
    return frozenset({"/health", "/metrics"} if metrics_public else {"/health"})


def install_api_key(app: FastAPI, api_key: str, metrics_public: bool = False) -> None:
    """Reject requests without the key, on every path but the open ones, with OpenAI's 401 (invalid_api_key)."""
    expected = f"Bearer {api_key}".encode()
    public = open_paths(metrics_public)

    @app.middleware("http")
    async def _check_key(request: Request, call_next):
        if request.url.path not in public:
            given = request.headers.get("authorization", "").encode()
            if not hmac.compare_digest(given, expected):
                message = ("missing API key: send it as the header Authorization: Bearer <key>" if not given
                           else "incorrect API key provided")
                return APIError(401, message, code="invalid_api_key",
                                headers={"WWW-Authenticate": "Bearer"}).response()
        return await call_next(request)


def admin_api_guard(enabled: bool):
    """A dependency for included routers: a route tagged `admin` answers 403 naming the flag unless enabled."""
    async def _require_admin_api(request: Request) -> None:
        route = request.scope.get("route")
        if not enabled and ADMIN_TAG in (getattr(route, "tags", None) or ()):
            raise APIError(403, f"{request.method} {request.url.path} is an admin route and the admin API is off; "
                                f"start the server with --enable-admin-api to use it", code="admin_api_disabled")
    return _require_admin_api
