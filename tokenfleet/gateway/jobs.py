"""One fleet job as seen by one HTTP request: its events, the client's disconnect, and
the rule that a job whose client is gone is cancelled (so its worker frees the KV
within a tick).

`JobEvents.next` races the job's next event against the client hanging up. Until
the response starts, the gateway watches the connection itself (`receive` yields
`http.disconnect`); once a streaming response has started, Starlette watches it
and cancels the response task, and `EventStreamResponse` runs `close` anyway.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

import anyio
from redis.exceptions import RedisError
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from tokenfleet.producer import AsyncJobHandle
from tokenfleet.protocol import FinishEvent, TokenEvent

Event = TokenEvent | FinishEvent
log = logging.getLogger(__name__)


class ClientGone(Exception):
    """The HTTP client disconnected before the job finished."""


class _Gone:
    """Queued by the hang-up watch: the client disconnected."""


class JobEvents:
    """Tokens in index order, then the finish event; `close` cancels an unfinished job.

    A pump task reads the job's events (`AsyncJobHandle.stream`) into a queue, and
    the hang-up watch puts `_Gone` into the same queue, so `next` is one queue read:
    no task per token."""

    def __init__(self, handle: AsyncJobHandle, receive: Receive | None) -> None:
        self.handle = handle
        self.finish: FinishEvent | None = None
        self.cancelled = False
        self._queue: asyncio.Queue[Event | _Gone | BaseException] = asyncio.Queue()
        self._pump = asyncio.create_task(self._read())
        self._hangup: asyncio.Task[None] | None = None
        if receive is not None:
            self._hangup = asyncio.create_task(self._watch(receive))

    async def _read(self) -> None:
        try:
            async for event in self.handle.stream():
                self._queue.put_nowait(event)
            assert self.handle.finish is not None
            self._queue.put_nowait(self.handle.finish)
        except Exception as exc:  # e.g. Redis went away: the reader of the queue raises it
            self._queue.put_nowait(exc)

    async def _watch(self, receive: Receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        self._queue.put_nowait(_Gone())

    async def next(self, timeout: float | None = None) -> Event | None:
        """The next event, or None when `timeout` seconds pass first.

        Raises `ClientGone` when the client disconnected (while watched), and whatever
        reading the job's events raised."""
        if self._queue.empty():
            try:
                async with asyncio.timeout(timeout):
                    item = await self._queue.get()
            except TimeoutError:
                return None
        else:
            item = self._queue.get_nowait()
        if isinstance(item, _Gone):
            raise ClientGone
        if isinstance(item, BaseException):
            raise item
        if isinstance(item, FinishEvent):
            self.finish = item
        return item

    def stop_watching(self) -> None:
        """Hand the connection to Starlette's own disconnect watch (streaming responses)."""
        if self._hangup is not None:
            self._hangup.cancel()
            self._hangup = None

    async def close(self) -> None:
        """Release everything; cancel the job in the fleet if it has not finished."""
        self.stop_watching()
        self._pump.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._pump
        if self.finish is None:
            try:
                self.cancelled = await self.handle.cancel()
            except RedisError as exc:
                log.warning("cannot cancel job %s (client gone): %s", self.handle.id, exc)


class EventStreamResponse(StreamingResponse):
    """`text/event-stream` whose `on_close` always runs, shielded, however it ends
    (finished, client gone, server shutting down)."""

    def __init__(
        self, content: AsyncIterator[bytes], on_close: Callable[[], Awaitable[None]]
    ) -> None:
        super().__init__(
            content,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self._on_close()
