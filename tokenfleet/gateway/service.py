"""How the gateway serves one request: OpenAI-compatible completions over the fleet.

One request is one job: validate (400 naming the field) → route by `model` (404
when live workers exist and none serves it) → refuse what no worker could ever
hold (400) → submit (429 + Retry-After when the stream is at its cap) → wait for
the first event (a rejection or failure before any token is an HTTP error) →
answer with one JSON body or a server-sent-event stream ending in `data: [DONE]`.
A client that hangs up has its job cancelled. docs/http.md is the reference; the
routes around this are in `app.py`.
"""

from __future__ import annotations

import logging
import re
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import Any, Literal

import anyio
import redis.asyncio as aredis
from pydantic import ValidationError
from redis.exceptions import RedisError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from tokenfleet.config import Settings
from tokenfleet.errors import InvalidRequest, JobRejected, QueueFull
from tokenfleet.gateway.errors import ApiError, from_finish, from_validation
from tokenfleet.gateway.fleet import FleetReader, ServedModel
from tokenfleet.gateway.jobs import ClientGone, EventStreamResponse, JobEvents
from tokenfleet.gateway.metrics import GatewayMetrics, RequestTally
from tokenfleet.gateway.openai_models import (
    DEFAULT_COMPLETION_MAX_TOKENS,
    ChatCompletionRequest,
    CompletionRequest,
)
from tokenfleet.gateway.render import DONE, KEEPALIVE, Renderer
from tokenfleet.keys import DEFAULT_MODEL, DEFAULT_PREFIX, DEFAULT_QUEUE_CAP, Keys
from tokenfleet.producer import AsyncJobHandle, AsyncProducer
from tokenfleet.protocol import (
    MAX_NEW_TOKENS,
    MODEL_NAME_PATTERN,
    FinishEvent,
    GenerationRequest,
    TokenEvent,
)
from tokenfleet.reasons import FinishReason

Kind = Literal["completions", "chat"]
log = logging.getLogger(__name__)
CLIENT_GONE = 499  # nginx's "client closed request": logged and counted, never sent


@dataclass(frozen=True)
class GatewayConfig:
    """How one gateway runs. Built at the edge (the CLI) from `Settings` and flags."""

    redis_url: str = "redis://127.0.0.1:6379/0"
    prefix: str = DEFAULT_PREFIX
    queue_cap: int = DEFAULT_QUEUE_CAP  # the cap of a stream that has none set yet
    api_keys: tuple[str, ...] = ()  # accepted bearer tokens; empty = no auth
    retry_after_s: int = 1  # the Retry-After of a 429
    default_max_tokens: int = 256  # chat requests that name no max_tokens
    job_timeout_s: float | None = None  # every job's deadline, from submit; None = none
    fleet_cache_s: float = 1.0  # how long a read of the workers' heartbeats is reused
    keepalive_s: float = 15.0  # an SSE comment after this much silence in a stream

    def __post_init__(self) -> None:
        if any(not key for key in self.api_keys):
            raise ValueError("an API key must not be empty")
        if self.retry_after_s < 0:
            raise ValueError("retry_after_s must be ≥ 0")
        if not 1 <= self.default_max_tokens <= MAX_NEW_TOKENS:
            raise ValueError(f"default_max_tokens must be 1 … {MAX_NEW_TOKENS}")
        if self.job_timeout_s is not None and self.job_timeout_s <= 0:
            raise ValueError("job_timeout_s must be > 0")
        if self.keepalive_s <= 0 or self.fleet_cache_s < 0:
            raise ValueError("keepalive_s must be > 0 and fleet_cache_s ≥ 0")

    @classmethod
    def from_settings(cls, settings: Settings, **overrides: Any) -> GatewayConfig:
        base = cls(
            redis_url=settings.redis_url, prefix=settings.prefix, queue_cap=settings.queue_cap
        )
        return replace(base, **overrides)


class Gateway:
    """What the routes share: the producer, the fleet view, the metrics."""

    def __init__(
        self, config: GatewayConfig, client: aredis.Redis, metrics: GatewayMetrics
    ) -> None:
        self.config = config
        self.redis = client
        self.keys = Keys(config.prefix)
        self.producer = AsyncProducer(client, keys=self.keys, default_cap=config.queue_cap)
        self.fleet = FleetReader(client, self.keys, config.fleet_cache_s)
        self.metrics = metrics

    # ---- one generation request ----------------------------------------------------

    async def generate(self, request: Request, kind: Kind) -> Response:
        arrived = time.monotonic()
        parsed = _parse(kind, await request.body())
        served = await self._route(parsed.model)
        job = self._job(parsed, kind, self._max_tokens(parsed, served))
        handle = await self._submit(job, parsed.model)
        tally = RequestTally(self.metrics, parsed.model, arrived)

        events = JobEvents(handle, request.receive)
        out = Renderer(kind, handle.id, parsed.model, int(time.time()))
        headers = {"X-Tokenfleet-Job-Id": handle.id}

        async def close() -> None:
            """Always run, shielded: a job whose client is gone is cancelled in the fleet."""
            with anyio.CancelScope(shield=True):
                await events.close()
            if events.cancelled:
                self.metrics.cancelled.labels(parsed.model).inc()

        try:
            first = await events.next()
            assert first is not None  # no timeout given
            if isinstance(first, FinishEvent) and first.reason in _FAILED:
                raise from_finish(first, self.config.retry_after_s)
            if parsed.stream:
                events.stop_watching()
                stream = self._stream(events, first, out, parsed.include_usage, tally)
                response: Response = EventStreamResponse(stream, on_close=close)
                response.headers.update(headers)
                return response
            text = await self._collect(events, first, tally)
        except ClientGone:
            await close()
            return Response(status_code=CLIENT_GONE)
        except BaseException:
            await close()
            raise
        await close()
        assert events.finish is not None
        return JSONResponse(out.body(text, events.finish).model_dump(mode="json"), headers=headers)

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
        self, parsed: CompletionRequest | ChatCompletionRequest, kind: Kind, max_tokens: int
    ) -> GenerationRequest:
        metadata: dict[str, Any] = {"via": "gateway", "endpoint": kind}
        if parsed.user:
            metadata["user"] = parsed.user
        deadline = None
        if self.config.job_timeout_s is not None:
            deadline = time.time() + self.config.job_timeout_s
        fields = {
            **parsed.prompt_fields(),
            **parsed.fleet_fields(max_tokens),
            "job_id": uuid.uuid4().hex,
            "model": None if parsed.model == DEFAULT_MODEL else parsed.model,
            "deadline": deadline,
            "metadata": metadata,
        }
        try:
            return GenerationRequest.model_validate(fields)
        except ValidationError as exc:  # the OpenAI models check the same limits first
            raise from_validation(exc) from None

    async def _submit(self, job: GenerationRequest, model: str) -> AsyncJobHandle:
        try:
            return await self.producer.submit(job)
        except QueueFull as exc:
            self.metrics.queue_full.labels(model).inc()
            raise ApiError(
                429,
                f"the queue for model {model!r} is full ({exc.depth} jobs, cap {exc.cap}): "
                "retry later",
                type="rate_limit_error",
                code="queue_full",
                headers={"Retry-After": str(self.config.retry_after_s)},
            ) from None
        except JobRejected as exc:  # the producer's own fleet check (token-id prompts)
            message = f"the fleet rejected the request ({exc.reason}): {exc.message}"
            raise ApiError(400, message, code=exc.reason) from None
        except InvalidRequest as exc:
            raise ApiError(400, str(exc), code="invalid_value") from None

    async def _collect(
        self, events: JobEvents, first: TokenEvent | FinishEvent, tally: RequestTally
    ) -> str:
        parts: list[str] = []
        event: TokenEvent | FinishEvent | None = first
        while not isinstance(event, FinishEvent):
            assert event is not None  # no timeout given
            tally.token(streamed=False)
            parts.append(event.text)
            event = await events.next()
        if event.reason in _FAILED:
            raise from_finish(event, self.config.retry_after_s)
        return "".join(parts)

    async def _stream(
        self,
        events: JobEvents,
        first: TokenEvent | FinishEvent,
        out: Renderer,
        usage: bool,
        tally: RequestTally,
    ) -> AsyncIterator[bytes]:
        """The SSE body. The status line is sent already: failures become an error event."""
        yield out.opening()
        event: TokenEvent | FinishEvent | None = first
        while True:
            if event is None:
                yield KEEPALIVE
            elif isinstance(event, TokenEvent):
                tally.token(streamed=True)
                if event.text:
                    yield out.delta(event.text)
            elif event.reason in _FAILED:
                yield from_finish(event, self.config.retry_after_s).sse() + DONE
                return
            else:
                yield out.closing(event, usage)
                return
            try:
                event = await events.next(timeout=self.config.keepalive_s)
            except ClientGone:
                return
            except RedisError as exc:
                yield redis_down(exc).sse() + DONE
                return
            except Exception as exc:
                log.exception("reading job %s failed", out.job_id)
                error = ApiError(500, f"reading the job failed: {exc}", type="server_error")
                yield error.sse() + DONE
                return


_FAILED = (FinishReason.REJECTED, FinishReason.ERROR)


def _parse(kind: Kind, body: bytes) -> CompletionRequest | ChatCompletionRequest:
    try:
        if kind == "chat":
            return ChatCompletionRequest.model_validate_json(body)
        return CompletionRequest.model_validate_json(body)
    except ValidationError as exc:
        raise from_validation(exc) from None


def redis_down(exc: RedisError) -> ApiError:
    return ApiError(
        503,
        f"the fleet's Redis is unavailable: {exc}",
        type="server_error",
        code="redis_unavailable",
    )
