"""`--max-request-body-bytes`: a pure ASGI middleware that refuses a larger body with a 413 in OpenAI's
shape, from its Content-Length before a byte is read, or as soon as its chunks add up past the limit."""
from __future__ import annotations

from typing import Any, Awaitable, Callable

from ecoserve.server.errors import APIError

DEFAULT_MAX_REQUEST_BODY_BYTES = 8 * 1024 * 1024

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


def body_too_large(limit: int, size: int | None = None) -> APIError:
    got = f", got {size} bytes" if size is not None else ""
    return APIError(413, f"the request body must be at most {limit} bytes (--max-request-body-bytes){got}",
                    code="request_too_large")


class BodyLimitMiddleware:
    """Counts each HTTP request's body as the app receives it; the app never holds more than `max_bytes`."""

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]], max_bytes: int) -> None:
        if max_bytes < 1:
            raise ValueError(f"max_request_body_bytes must be >= 1, got {max_bytes}")
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            await body_too_large(self.max_bytes, declared).response()(scope, receive, send)
            return
        received = 0
        started = False

        async def counted_receive() -> dict[str, Any]:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise body_too_large(self.max_bytes)  # the app's handler answers it as a 413
            return message

        async def tracked_send(message: dict[str, Any]) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted_receive, tracked_send)
        except APIError as e:  # raised where no handler of the app saw it
            if started:
                raise
            await e.response()(scope, receive, send)


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None
