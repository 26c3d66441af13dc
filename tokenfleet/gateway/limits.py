"""The request body limit, enforced before a body is read whole.

`BodyLimit` is pure ASGI middleware: a `Content-Length` over the limit is answered
413 without reading a byte of the body; a chunked body (or one that lies about
its length) is counted as it is received, and the request fails with 413 the
moment the count passes the limit, so the gateway never buffers more than
`max_bytes` of any body. A 413 closes the connection: the rest of the body is
never read.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tokenfleet.gateway.errors import ApiError
from tokenfleet.gateway.metrics import GatewayMetrics


class BodyTooLarge(ApiError):
    def __init__(self, limit: int, seen: int | None = None) -> None:
        size = f"{seen:,} bytes" if seen is not None else f"more than {limit:,} bytes"
        super().__init__(
            413,
            f"the request body is {size}; the limit is {limit:,} bytes (--max-body-bytes)",
            code="body_too_large",
            headers={"Connection": "close"},
        )


class BodyLimit:
    """`max_bytes` per body; `per_path` raises it for some paths (file uploads)."""

    def __init__(
        self,
        app: ASGIApp,
        max_bytes: int,
        metrics: GatewayMetrics,
        per_path: dict[str, int] | None = None,
    ) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.metrics = metrics
        self.per_path = per_path or {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.per_path.get(scope.get("path", ""), self.max_bytes)
        for name, value in scope["headers"]:
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = -1
                if declared > limit:
                    self.metrics.body_too_large.inc()
                    await BodyTooLarge(limit, declared).response()(scope, receive, send)
                    return
                break
        seen = 0

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    self.metrics.body_too_large.inc()
                    raise BodyTooLarge(limit)
            return message

        await self.app(scope, counted, send)
