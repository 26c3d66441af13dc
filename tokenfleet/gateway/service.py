"""How the gateway serves one request: OpenAI-compatible completions over the fleet.

One request is one job: validate (400 naming the field) → route by `model` (404
when live workers exist and none serves it) → refuse what no worker could ever
hold (400) → submit, in the band the request or its API key asks for and under the
key's tenant (429 + Retry-After when the band's stream is at its cap, or the tenant at
its limit of queued jobs). Then a
non-streamed request waits for its job's end (a rejection or failure is an HTTP
error; no worker starting it within the queue timeout is a 503 + Retry-After) and
gets one JSON body; a streamed one gets its headers at once and a server-sent-event
stream — keep-alive comments while it waits, the tokens, `data: [DONE]` — whose
errors are error events. A client that hangs up, or whose job timed out in the
queue, has its job cancelled. docs/http.md is the reference; the routes around
this are in `app.py`.
"""

from __future__ import annotations

import logging
import re
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

import anyio
import redis.asyncio as aredis
from pydantic import ValidationError
from redis.exceptions import RedisError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from tokenfleet.config import GatewayConfig
from tokenfleet.errors import (
    InvalidRequest,
    JobLost,
    JobRejected,
    NotReplicated,
    QueueFull,
    TenantQueueFull,
)
from tokenfleet.fleet import FleetReader, ServedModel
from tokenfleet.gateway import fanout
from tokenfleet.gateway.auth import ANONYMOUS, Caller, caller_of
from tokenfleet.gateway.failures import CLIENT_GONE, job_lost
from tokenfleet.gateway.failures import redis_down as redis_down  # app.py imports it here
from tokenfleet.gateway.jobs import (
    Canceller,
    ClientGone,
    EventStreamResponse,
    JobEvents,
    QueueTimeout,
)
from tokenfleet.gateway.metrics import GatewayMetrics, RequestTally
from tokenfleet.gateway.output import Output, OutputFactory, Rendered
from tokenfleet.gateway.subscriber import LiveChannels
from tokenfleet.keys import DEFAULT_MODEL
from tokenfleet.openai.errors import ApiError, from_finish, from_queue_full, from_validation
from tokenfleet.openai.fields import IGNORED_HEADER, ignored_fields
from tokenfleet.openai.models import (
    DEFAULT_COMPLETION_MAX_TOKENS,
    FAN_OUT,
    SERVICE_TIER_OF,
    ChatCompletionRequest,
    CompletionRequest,
    job_from_openai,
)
from tokenfleet.openai.render import KEEPALIVE, echoes, reads_calls
from tokenfleet.producer import AsyncProducer
from tokenfleet.protocol import (
    MODEL_NAME_PATTERN,
    FinishEvent,
    GenerationRequest,
    TokenEvent,
)
from tokenfleet.reasons import QUEUE_DEADLINE_REASON, FinishReason

Kind = Literal["completions", "chat"]
log = logging.getLogger(__name__)


class Gateway:
    """What the routes share: the producer, the shared pub/sub subscriber, the cancels
    being retried, the fleet view, the metrics."""

    def __init__(
        self,
        config: GatewayConfig,
        client: aredis.Redis,
        metrics: GatewayMetrics,
        subscriber: LiveChannels,
    ) -> None:
        self.config = config
        self.redis = client
        self.keys = config.keys()
        self.producer = AsyncProducer(
            client, keys=self.keys, default_cap=config.queue_cap, wait_replicas=config.wait_replicas
        )
        self.fleet = FleetReader(client, self.keys, config.fleet_cache_s)
        self.metrics = metrics
        self.subscriber = subscriber
        self.canceller = Canceller(config.cancel_retry_s)

    # ---- one generation request ----------------------------------------------------

    async def generate(self, request: Request, kind: Kind) -> Response:
        arrived = time.monotonic()
        parsed = _parse(kind, await request.body())
        if fanout.fans_out(parsed):  # n > 1 or several prompts: one job per choice
            return await fanout.serve_choices(self, request, parsed, kind, arrived)
        return await self.serve(request, parsed, kind, arrived)

    async def serve(
        self,
        request: Request,
        parsed: CompletionRequest | ChatCompletionRequest,
        kind: Kind,
        arrived: float,
        output: OutputFactory | None = None,
    ) -> Response:
        """One parsed request as one job, shown by `output` (completions and chat: the
        OpenAI bodies and chunks; the Responses API translates its request into a chat
        request and shows the job its own way)."""
        served = await self._route(parsed.model)
        job = self._job(parsed, kind, self._max_tokens(parsed, served), served, caller_of(request))
        handle = self.producer.handle(job.job_id)
        events = JobEvents(
            handle,
            self.subscriber,
            self.canceller,
            None if parsed.stream else request.receive,  # Starlette watches streams
            queue_timeout_s=self.config.queue_timeout_s,
            outage_s=self.config.redis_outage_s,
        )
        try:
            await events.subscribed(self.config.redis_wait_s)  # before the job can publish
            await self._submit(job, parsed.model, served)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await events.close(cancel=False)
            raise
        tier = SERVICE_TIER_OF[job.priority]
        out = (
            output(handle.id, tier)
            if output is not None
            else Rendered(
                kind,
                handle.id,
                parsed.model,
                int(time.time()),
                tier,
                **reads_calls(parsed, served),
                **echoes(parsed, job.prompt),
            )
        )
        headers = {"X-Tokenfleet-Job-Id": handle.id}
        ignored = ignored_fields(parsed)
        if ignored:  # accepted, not acted on: the client hears of it, and so does the log
            headers[IGNORED_HEADER] = ", ".join(ignored)
            log.warning(
                "%s %s: ignored fields %s (job %s)",
                request.method,
                request.url.path,
                ", ".join(ignored),
                handle.id,
            )

        tally = RequestTally(self.metrics, parsed.model, arrived)

        async def close() -> None:
            """Always run, shielded: a job whose client is gone (or that timed out in the
            queue) is cancelled in the fleet."""
            with anyio.CancelScope(shield=True):
                await events.close()
            if events.cancelled:
                self.metrics.cancelled.labels(parsed.model).inc()
            tally.ended([events.finish], events.finished_at)

        if parsed.stream:  # the status line goes now: whatever fails later is an event
            stream = self._stream(events, out, parsed.include_usage, tally)
            response: Response = EventStreamResponse(stream, on_close=close)
            response.headers.update(headers)
            return response
        try:
            tokens = await self._collect(events, tally)
        except ClientGone:
            await close()
            return Response(status_code=CLIENT_GONE)
        except (QueueTimeout, JobLost, ApiError) as exc:
            await close()
            if isinstance(exc, QueueTimeout):
                error = self._queue_timeout(exc.timeout_s, parsed.model)
            else:
                error = job_lost(exc) if isinstance(exc, JobLost) else exc
            error.headers.update(headers)  # the job it was about
            raise error from None
        except BaseException:
            await close()
            raise
        await close()
        assert events.finish is not None
        return JSONResponse(await _answer(out, tokens, events.finish), headers=headers)

    def _queue_timeout(self, timeout_s: float, model: str) -> ApiError:
        self.metrics.queue_timeouts.labels(model).inc()
        return ApiError(
            503,
            f"no worker started the job within the queue timeout ({timeout_s:g} s); it was "
            "cancelled: retry later",
            type="server_error",
            code="queue_timeout",
            headers={"Retry-After": str(max(1, self.config.retry_after_s))},
        )

    def stream_failure(self, exc: Exception, model: str, job_id: str) -> ApiError | None:
        """The error event a stream ends with when following its job (or jobs) raised
        `exc`; None when the client is gone (nothing more to send)."""
        if isinstance(exc, ClientGone):
            return None
        if isinstance(exc, QueueTimeout):
            return self._queue_timeout(exc.timeout_s, model)
        if isinstance(exc, JobLost):
            return job_lost(exc)
        if isinstance(exc, RedisError):
            return redis_down(exc)
        log.error("reading job %s failed", job_id, exc_info=exc)
        return ApiError(500, f"reading the job failed: {exc}", type="server_error")

    def _failure(self, finish: FinishEvent, model: str, *, tokens_seen: bool) -> ApiError | None:
        """The HTTP error a job's end means, or None when it is an answer (a queue deadline
        is a queue timeout only when no token came before it)."""
        if finish.reason in _FAILED:
            return from_finish(finish, self.config.retry_after_s)
        if (
            not tokens_seen
            and finish.reason == FinishReason.DEADLINE
            and finish.error is not None
            and finish.error.reason == QUEUE_DEADLINE_REASON
            and finish.usage.completion_tokens == 0
            and self.config.queue_timeout_s is not None
        ):
            return self._queue_timeout(self.config.queue_timeout_s, model)
        return None

    async def _route(self, model: str) -> ServedModel | None:
        """The live workers serving `model`; None when there are none (jobs queue anyway)."""
        models = (await self.fleet.read()).models
        if models and model != DEFAULT_MODEL and model not in models:
            raise ApiError(
                404,
                f"the model {model!r} is not served by any live worker; "
                f"served: {', '.join(sorted(models))} (GET /v1/models)",
                param="model",
                code="model_not_found",
            )
        if re.fullmatch(MODEL_NAME_PATTERN, model) is None:
            raise ApiError(
                400,
                f"model {model!r} is not a fleet model name ({MODEL_NAME_PATTERN})",
                param="model",
                code="invalid_value",
            )
        return models.get(model)

    def _max_tokens(
        self, parsed: CompletionRequest | ChatCompletionRequest, served: ServedModel | None
    ) -> int:
        """The request's max_tokens (or a default), checked against the biggest job any live
        worker of the model can hold. The prompt's length is unknown here (no tokenizer), so
        this counts it as one token; a longer prompt that cannot fit is the worker's
        `rejected_kv_budget`, which comes back as a 400 too."""
        asked = parsed.max_tokens
        if isinstance(parsed, ChatCompletionRequest):
            asked = parsed.max_completion_tokens or asked
        capacity = served.max_job_tokens if served is not None else None
        if asked is None:
            default = (
                self.config.default_max_tokens
                if isinstance(parsed, ChatCompletionRequest)
                else DEFAULT_COMPLETION_MAX_TOKENS
            )
            return max(1, min(default, capacity - 1)) if capacity else default
        if capacity is not None and asked + 1 > capacity:
            raise ApiError(
                400,
                f"max_tokens={asked} can never fit: the live workers serving {parsed.model!r} "
                f"hold at most {capacity:,} tokens per job (prompt + max_tokens)",
                param="max_tokens",
                code="rejected_kv_budget",
            )
        return asked

    def _job(
        self,
        parsed: CompletionRequest | ChatCompletionRequest,
        kind: Kind,
        max_tokens: int,
        served: ServedModel | None = None,
        caller: Caller = ANONYMOUS,
    ) -> GenerationRequest:
        """The job: in the band the request asks for (the key's default when it asks for
        none), for the key's tenant (a client cannot name another)."""
        metadata: dict[str, Any] = {"via": "gateway", "endpoint": kind}
        if parsed.user:
            metadata["user"] = parsed.user
        now = time.time()
        deadline = queue_deadline = None
        if self.config.job_timeout_s is not None:
            deadline = now + self.config.job_timeout_s
        if self.config.queue_timeout_s is not None:  # a job deadline before it still
            queue_deadline = now + self.config.queue_timeout_s  # ends it as `deadline`
        try:
            return job_from_openai(
                parsed,
                job_id=uuid.uuid4().hex,
                max_tokens=max_tokens,
                sampling_defaults=served.sampling_defaults if served else None,
                metadata=metadata,
                deadline=deadline,
                queue_deadline=queue_deadline,
                priority=parsed.band(caller.priority),
                tenant=caller.tenant,
            )
        except ValidationError as exc:  # the OpenAI models check the same limits first
            raise from_validation(exc) from None

    async def _submit(self, job: GenerationRequest, model: str, served: ServedModel | None) -> None:
        """Submit with the fleet's capacity from the gateway's own (shared, cached) fleet
        view: one EVALSHA per request and nothing else."""
        try:
            capacity = served.max_job_tokens if served is not None else None
            await self.producer.submit(job, capacity=capacity)
        except QueueFull as exc:
            if isinstance(exc, TenantQueueFull):
                self.metrics.tenant_queue_full.labels(model, exc.tenant).inc()
            else:
                self.metrics.queue_full.labels(model).inc()
            raise from_queue_full(exc, model, self.config.retry_after_s) from None
        except JobRejected as exc:  # the producer's own fleet check (token-id prompts)
            message = f"the fleet rejected the request ({exc.reason}): {exc.message}"
            raise ApiError(400, message, code=exc.reason) from None
        except InvalidRequest as exc:
            raise ApiError(400, str(exc), code="invalid_value") from None
        except NotReplicated as exc:  # queued, not safe from a failover yet: the client
            # retries with a new request, so this one is cancelled (a worker drops it)
            await self.canceller.cancel(self.producer.handle(job.job_id))
            raise ApiError(
                503,
                str(exc),
                type="server_error",
                code="not_replicated",
                headers={"Retry-After": str(max(1, self.config.retry_after_s))},
            ) from None

    async def _collect(self, events: JobEvents, tally: RequestTally) -> list[TokenEvent]:
        parts: list[TokenEvent] = []
        while True:
            event = await events.next()
            assert event is not None  # no timeout given
            if isinstance(event, FinishEvent):
                break
            tally.token(streamed=False)
            parts.append(event)
        failure = self._failure(event, tally.model, tokens_seen=bool(parts))
        if failure is not None:
            raise failure
        return parts

    async def _stream(
        self, events: JobEvents, out: Output, usage: bool, tally: RequestTally
    ) -> AsyncIterator[bytes]:
        """The SSE body. The status line is sent already: failures become an error event
        (then `data: [DONE]`); silences of `keepalive_s`, a keep-alive comment."""
        opened = False
        while True:
            try:
                event = await events.next(timeout=self.config.keepalive_s)
            except Exception as exc:
                error = self.stream_failure(exc, tally.model, out.job_id)
                if error is not None:
                    yield await out.failed(error)
                return
            if event is None:
                yield KEEPALIVE
                continue
            if isinstance(event, TokenEvent):
                tally.token(streamed=True)
                head = b"" if opened else out.opening()
                opened = True
                chunk = _chunk(out, event)
                if chunk or head:
                    yield head + chunk
                continue
            failure = self._failure(event, tally.model, tokens_seen=opened)
            if failure is not None:
                yield await out.failed(failure)
            else:
                yield (b"" if opened else out.opening()) + await out.ended(event, usage)
            return


def _chunk(out: Output, event: TokenEvent) -> bytes:
    """A token's bytes: completions and chat completions render its logprobs and the
    echo too (`Renderer.token`); other outputs show the text alone."""
    if isinstance(out, Rendered):
        return out.token(event)
    return out.delta(event.text) if event.text else b""


async def _answer(out: Output, tokens: list[TokenEvent], finish: FinishEvent) -> dict[str, Any]:
    """The non-streamed body; completions and chat completions carry the tokens' logprobs
    when the job asked for them, and the echo (`Renderer.answer_of`)."""
    if isinstance(out, Rendered):
        return out.answer_of(tokens, finish).model_dump(mode="json")
    return await out.answer("".join(e.text for e in tokens), finish)


_FAILED = (FinishReason.REJECTED, FinishReason.ERROR)


def _parse(kind: Kind, body: bytes) -> CompletionRequest | ChatCompletionRequest:
    try:
        model = ChatCompletionRequest if kind == "chat" else CompletionRequest
        return model.model_validate_json(body, context={FAN_OUT: True})  # gateway/fanout.py
    except ValidationError as exc:
        raise from_validation(exc) from None
