"""One fleet job as seen by one HTTP request: its events, the client's disconnect, the
queue timeout, and the rule that a job whose client is gone is cancelled (so its
worker frees the KV within a tick).

Events come from the gateway's shared `Subscriber` (no pub/sub connection per
request) into one queue per request, and are put in order by the producer's
`EventAssembler`; whatever pub/sub missed (before the subscription, across a
reconnect, a gap) is re-read from the job's replay stream. `JobEvents.next` races
the job's next event against the client hanging up. Until the response starts,
the gateway watches the connection itself (`receive` yields `http.disconnect`);
once a streaming response has started, Starlette watches it and cancels the
response task, and `EventStreamResponse` runs `close` anyway.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable

import anyio
import redis.asyncio as aredis
from redis.exceptions import RedisError
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from tokenfleet.backoff import Backoff
from tokenfleet.errors import JobLost
from tokenfleet.gateway.subscriber import LiveChannels, Resync
from tokenfleet.keys import Keys
from tokenfleet.producer import AsyncJobHandle
from tokenfleet.producer.common import EventAssembler
from tokenfleet.protocol import FinishEvent, TokenEvent

Event = TokenEvent | FinishEvent
log = logging.getLogger(__name__)

# Every stream of a gateway shares a few pub/sub connections, which hand each watcher
# RESYNC after a reconnect, and a gap in the indexes triggers a replay: this poll only
# catches a dropped message with nothing after it (the finish). With thousands of
# streams open it must be rare: at the producer's 0.5 s (producer/follow.py, one job on
# its own subscription), 10,000 streams would be 20,000 XRANGEs a second.
SHARED_SUBSCRIPTION_POLL_S = 10.0
RETRY_S = 0.5  # a replay or status read that failed on Redis is tried again after this
CANCEL_RETRY_FIRST_S = 0.2  # a cancel that could not be sent is retried after this; it
CANCEL_RETRY_MAX_S = 10.0  # doubles per failure up to this


class ClientGone(Exception):
    """The HTTP client disconnected before the job finished."""


class QueueTimeout(Exception):
    """No worker started the job within its queue timeout (it is still `queued`)."""

    def __init__(self, timeout_s: float) -> None:
        super().__init__(f"no worker started the job within {timeout_s:g} s")
        self.timeout_s = timeout_s


class _Gone:
    """Queued by the hang-up watch: the client disconnected."""


class Canceller:
    """Sends cancels; one that fails on Redis is retried in the background, with backoff,
    for up to `give_up_s` (a job is not worth cancelling once it would have ended)."""

    def __init__(self, give_up_s: float) -> None:
        self.give_up_s = give_up_s
        self._retries: set[asyncio.Task[None]] = set()

    @property
    def pending(self) -> int:
        return len(self._retries)

    async def cancel(self, handle: AsyncJobHandle) -> bool:
        """True when the job was cancelled now or will be by a retry; False: it had finished."""
        try:
            return await handle.cancel()
        except RedisError as exc:
            log.warning("cannot cancel job %s now (%s): retrying in the background", handle.id, exc)
        task = asyncio.create_task(self._retry(handle))
        self._retries.add(task)
        task.add_done_callback(self._retries.discard)
        return True

    async def _retry(self, handle: AsyncJobHandle) -> None:
        backoff = Backoff(
            CANCEL_RETRY_FIRST_S, CANCEL_RETRY_MAX_S, jitter=0.0, limit_s=self.give_up_s
        )
        pause = backoff.failed(time.monotonic())  # the try `cancel` made
        while True:
            await asyncio.sleep(pause)
            try:
                await handle.cancel()
                log.info("job %s cancelled after a retry", handle.id)
                return
            except RedisError as exc:
                now = time.monotonic()
                pause = backoff.failed(now)
                if backoff.over(now):
                    log.error("giving up cancelling job %s: %s", handle.id, exc)
                    return

    async def aclose(self) -> None:
        for task in list(self._retries):
            task.cancel()
        for task in list(self._retries):
            with contextlib.suppress(asyncio.CancelledError):
                await task


class JobEvents:
    """Tokens in index order, then the finish event; `close` cancels an unfinished job.

    Made before the job is submitted: `subscribed()` waits until Redis confirmed the
    subscription to the job's channel, so every event the job ever publishes comes
    over pub/sub and no replay is needed to start (the replay stream is read only for
    gaps, reconnects and a slow poll). The shared subscriber and the hang-up watch
    both put into one queue, so `next` is one queue read: no task per token.
    `queue_timeout_s`: when nothing arrived that long after submit, the job's status
    is read; still `queued` raises `QueueTimeout`.
    `outage_s`: how long Redis may be unreachable before `next` raises its error."""

    def __init__(
        self,
        handle: AsyncJobHandle,
        subscriber: LiveChannels,
        canceller: Canceller,
        receive: Receive | None,
        *,
        queue_timeout_s: float | None = None,
        outage_s: float = 60.0,
    ) -> None:
        self.handle = handle
        self.finish: FinishEvent | None = None
        self.finished_at: float | None = None  # time.monotonic() when `finish` came
        self.cancelled = False
        self.started = False  # a worker took the job (status running, or an event came)
        self._redis: aredis.Redis = handle.producer.redis
        self._keys: Keys = handle.producer.keys
        self._subscriber = subscriber
        self._canceller = canceller
        self._asm = EventAssembler()
        self._ready: deque[Event] = deque()
        self._queue: asyncio.Queue[bytes | Resync | _Gone] = asyncio.Queue()
        self._channel = self._keys.channel(handle.id)
        self._queue_timeout_s = queue_timeout_s
        now = time.monotonic()
        self._queue_by = None if queue_timeout_s is None else now + queue_timeout_s
        self._poll_at = now + SHARED_SUBSCRIPTION_POLL_S
        self._outage = Backoff(RETRY_S, RETRY_S, jitter=0.0, limit_s=outage_s)
        self._closed = False
        self._subscribed = asyncio.Event()
        self._submitted = False  # from now on the job may exist and publish
        self._sink = self._deliver
        subscriber.watch(self._channel, self._sink)
        self._hangup: asyncio.Task[None] | None = None
        if receive is not None:
            self._hangup = asyncio.create_task(self._watch(receive))

    def _deliver(self, item: bytes | Resync) -> None:
        """The subscriber's sink. The first confirmation of the subscription, before the
        job exists, needs no replay; every later one (a reconnect) does."""
        if isinstance(item, Resync) and not self._subscribed.is_set():
            self._subscribed.set()
            if not self._submitted:
                return
        self._queue.put_nowait(item)

    async def subscribed(self, timeout: float) -> None:
        """Until the job's channel is subscribed (at most `timeout` s, and not at all
        while its pub/sub connection is down: then the replay stream catches up once it
        is back); call just before submitting the job."""
        if self._subscriber.is_up(self._channel):
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    await self._subscribed.wait()
        self._submitted = True

    async def _watch(self, receive: Receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        self._queue.put_nowait(_Gone())

    async def next(self, timeout: float | None = None) -> Event | None:
        """The next event, or None when `timeout` seconds pass first.

        Raises `ClientGone` when the client disconnected (while watched), `QueueTimeout`,
        `JobLost`, and Redis's error once it has been unreachable for `outage_s`."""
        until = None if timeout is None else time.monotonic() + timeout
        while not self._ready:
            item = self._queue.get_nowait() if not self._queue.empty() else await self._wait(until)
            if item is None:  # a timer is due
                if await self._run_timers(until):
                    return None
                continue
            if isinstance(item, bytes):
                self._asm.feed_raw(item, live=True)
                self.started = True
                if self._asm.gap:
                    await self._replay()
            elif isinstance(item, Resync):
                await self._replay()
            else:
                raise ClientGone
            self._ready.extend(self._asm.ready())
        event = self._ready.popleft()
        self._poll_at = time.monotonic() + SHARED_SUBSCRIPTION_POLL_S
        if isinstance(event, FinishEvent):
            self.finish = event
            self.finished_at = time.monotonic()
        return event

    async def _wait(self, until: float | None) -> bytes | Resync | _Gone | None:
        """The next queued item, or None once the first timer is due: the caller's
        `until`, the replay poll, the queue timeout (while no worker started the job)."""
        wake = self._poll_at
        if until is not None:
            wake = min(wake, until)
        if self._queue_by is not None and not self.started:
            wake = min(wake, self._queue_by)
        try:
            async with asyncio.timeout(max(0.0, wake - time.monotonic())):
                return await self._queue.get()
        except TimeoutError:
            return None

    async def _run_timers(self, until: float | None) -> bool:
        """What is due now: the queue-timeout check, the replay poll. True: `until`
        passed with nothing ready."""
        now = time.monotonic()
        if self._queue_by is not None and not self.started and now >= self._queue_by:
            await self._check_started()
        if now >= self._poll_at:
            await self._replay()
        return not self._ready and until is not None and now >= until

    async def _replay(self) -> None:
        """Everything in the replay stream after the last entry read (XRANGE, exclusive)."""
        asm = self._asm
        try:
            pipe = self._redis.pipeline(transaction=False)
            pipe.xrange(self._keys.events(self.handle.id), asm.replay_start(), "+")
            # after the XRANGE: a durable fleet's bound was set with the events it holds
            pipe.hget(self._keys.job(self.handle.id), "durable")
            entries, durable = await pipe.execute()
        except RedisError as exc:
            self._outage_failed(exc)
            return
        self._outage.succeeded()
        self._poll_at = time.monotonic() + SHARED_SUBSCRIPTION_POLL_S
        asm.bound(durable)
        if asm.feed_entries(entries):
            self.started = True
        self._ready.extend(asm.ready())

    async def _check_started(self) -> None:
        assert self._queue_timeout_s is not None
        try:
            status = await self._redis.hget(self._keys.job(self.handle.id), "status")
        except RedisError as exc:
            self._queue_by = time.monotonic() + self._outage_failed(exc)
            return
        if status == b"queued":
            raise QueueTimeout(self._queue_timeout_s)
        if status is None:
            raise JobLost(self.handle.id, "its job hash is gone")
        self.started = True  # running (or finished: the replay below reads its end)
        await self._replay()

    def _outage_failed(self, exc: RedisError) -> float:
        """Redis did not answer: the pause before trying again (RETRY_S; the replay poll
        moves to then), until Redis has been gone for `outage_s`: then raise `exc`."""
        now = time.monotonic()
        pause = self._outage.failed(now)
        if self._outage.over(now):
            raise exc
        self._poll_at = now + pause
        return pause

    def stop_watching(self) -> None:
        """Hand the connection to Starlette's own disconnect watch (streaming responses)."""
        if self._hangup is not None:
            self._hangup.cancel()
            self._hangup = None

    async def close(self, *, cancel: bool = True) -> None:
        """Release everything; cancel the job in the fleet if it has not finished
        (`cancel=False`: it was never accepted)."""
        if self._closed:
            return
        self._closed = True
        self.stop_watching()
        self._subscriber.unwatch(self._channel, self._sink)
        if cancel and self.finish is None:
            self.cancelled = await self._canceller.cancel(self.handle)


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
