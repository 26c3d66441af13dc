"""The request body limit, enforced before a body is read whole.

`BodyLimit` is pure ASGI middleware: a `Content-Length` over the limit is answered
413 without reading a byte of the body; a chunked body (or one that lies about
its length) is counted as it is received, and the request fails with 413 the
moment the count passes the limit, so the gateway never buffers more than
`max_bytes` of any body. A 413 closes the connection: the rest of the body is
never read. Each limit says what sets it, so the 413 names the setting that
applied (`--max-body-bytes`, or the file limit on the upload route).
"""

from __future__ import annotations

from dataclasses import dataclass

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tokenfleet.gateway.metrics import GatewayMetrics
from tokenfleet.gateway.responses import error_response
from tokenfleet.openai.errors import ApiError


@dataclass(frozen=True)
class Limit:
    """A body limit in bytes and, for the 413's message, what sets it and its code."""

    max_bytes: int
    source: str = "--max-body-bytes"
    code: str = "body_too_large"
    param: str | None = None


class BodyTooLarge(ApiError):
    def __init__(self, limit: Limit, seen: int | None = None) -> None:
        size = f"{seen:,} bytes" if seen is not None else f"more than {limit.max_bytes:,} bytes"
        super().__init__(
            413,
            f"the request body is {size}; the limit is {limit.max_bytes:,} bytes ({limit.source})",
            code=limit.code,
            param=limit.param,
            headers={"Connection": "close"},
        )


class BodyLimit:
    """`max_bytes` per body (`--max-body-bytes`); `per_path` sets other limits for some
    paths (file uploads)."""

    def __init__(
        self,
        app: ASGIApp,
        max_bytes: int,
        metrics: GatewayMetrics,
        per_path: dict[str, Limit] | None = None,
    ) -> None:
        self.app = app
        self.limit = Limit(max_bytes)
        self.metrics = metrics
        self.per_path = per_path or {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.per_path.get(scope.get("path", ""), self.limit)
        for name, value in scope["headers"]:
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = -1
                if declared > limit.max_bytes:
                    self.metrics.body_too_large.inc()
                    await error_response(BodyTooLarge(limit, declared))(scope, receive, send)
                    return
                break
        seen = 0

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit.max_bytes:
                    self.metrics.body_too_large.inc()
                    raise BodyTooLarge(limit)
            return message

        await self.app(scope, counted, send)
