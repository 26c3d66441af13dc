"""The gateway's FastAPI app: routes, API keys, error bodies, metrics.

`create_app(config)` builds it; `service.Gateway` does the work of each
completion request; `auth.KeyCheck` says which API key (tenant, default priority)
sent it. Redis is reached through one bounded pool of command
connections that requests wait for (never "Too many connections"; on a Redis
Cluster a bounded pool per node, which does not wait: `connect.connect_async_pooled`)
and the `Subscriber`'s few pub/sub connections, which every stream shares. docs/http.md
is the reference for clients.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from redis.exceptions import RedisError
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse, Response

from tokenfleet.batch.driver import BatchDriver, DriverConfig
from tokenfleet.batch.store import BatchStore, NotFound
from tokenfleet.config import GatewayConfig
from tokenfleet.connect import connect_async_pooled
from tokenfleet.fleet import ServedModel
from tokenfleet.gateway.auth import KeyCheck, parse_api_keys
from tokenfleet.gateway.batches import not_found
from tokenfleet.gateway.batches import router as batches_router
from tokenfleet.gateway.limits import BodyLimit, Limit
from tokenfleet.gateway.metrics import GatewayMetrics, RequestCounter
from tokenfleet.gateway.responses import error_response
from tokenfleet.gateway.service import Gateway, redis_down
from tokenfleet.gateway.subscriber import subscriber_for
from tokenfleet.openai.errors import ApiError
from tokenfleet.openai.models import ModelCard, ModelList

CLIENT_NAME = "tokenfleet-gateway"  # the command connections, in CLIENT LIST
FORM_BYTES = 64 * 1024  # what an upload's multipart form may add around its file


def create_app(config: GatewayConfig) -> FastAPI:
    """The gateway's FastAPI app. Redis is connected on startup, closed on shutdown.
    A bad API key entry is a ValueError naming its position (never the key)."""
    require_key = KeyCheck(parse_api_keys(config.api_keys))  # leaves request.state.caller
    metrics = GatewayMetrics()
    app = FastAPI(
        title="tokenfleet gateway",
        summary="OpenAI-compatible completions served by a tokenfleet fleet",
        lifespan=partial(serving, config=config, metrics=metrics),
        docs_url=None,  # bodies are parsed by hand (OpenAI-style errors): no useful schema
        redoc_url=None,
        openapi_url=None,
    )
    app.add_middleware(
        BodyLimit,
        max_bytes=config.max_body_bytes,
        metrics=metrics,
        per_path={"/v1/files": upload_limit(config)},
    )
    app.add_middleware(RequestCounter, metrics=metrics)  # outermost: counts the 413s too
    add_error_handlers(app)
    authed = [Depends(require_key)]
    app.include_router(completion_routes(authed))
    app.include_router(fleet_routes(authed, metrics))
    app.include_router(batches_router(authed))
    from tokenfleet.gateway.responses_api import router as responses_router

    app.include_router(responses_router(authed))
    return app


# ---- start-up and shut-down ----------------------------------------------------------


@asynccontextmanager
async def serving(
    app: FastAPI, config: GatewayConfig, metrics: GatewayMetrics
) -> AsyncIterator[None]:
    """The app's lifespan: the Redis pool, the shared subscriber, the `Gateway` and the
    batch store on `app.state`, and (where `config.batches`) this replica's batch driver."""
    client, pool = connect_async_pooled(
        config.redis_url,
        max_connections=config.redis_connections,
        timeout=config.redis_wait_s,
        health_check_interval=10,
        client_name=CLIENT_NAME,
    )
    subscriber = subscriber_for(client, pool, config.pubsub_connections)
    subscriber.start()
    gw = Gateway(config, client, metrics, subscriber)
    store = BatchStore(
        client,
        gw.keys,
        max_file_bytes=config.max_file_bytes,
        lease_ms=int(config.batch_lease_s * 1000),
    )
    driver = asyncio.create_task(drive_batches(store, gw, config)) if config.batches else None
    watch_gauges(metrics, gw)
    app.state.gateway, app.state.batch_store = gw, store
    try:
        yield
    finally:
        if driver is not None:
            driver.cancel()
            with contextlib.suppress(BaseException):
                await driver
        await gw.canceller.aclose()
        await subscriber.aclose()
        await client.aclose()
        await pool.aclose()


async def drive_batches(store: BatchStore, gw: Gateway, config: GatewayConfig) -> None:
    driver = BatchDriver(
        store,
        gw.producer,
        DriverConfig(
            max_in_flight=config.batch_max_in_flight,
            queue_share=config.batch_queue_share,
            chat_max_tokens=config.default_max_tokens,
        ),
    )
    await driver.run()


def watch_gauges(metrics: GatewayMetrics, gw: Gateway) -> None:
    """The gauges read from this replica's own state when /metrics is scraped."""
    metrics.watch("live_streams", lambda: gw.subscriber.watched)
    metrics.watch("pubsub_connections", lambda: gw.subscriber.connected)
    metrics.watch("pubsub_reconnects", lambda: gw.subscriber.reconnects)
    metrics.watch("cancel_retries", lambda: gw.canceller.pending)


def upload_limit(config: GatewayConfig) -> Limit:
    """The body limit of `POST /v1/files`: the file limit and room for the form around
    it, or the general body limit where that is bigger (the 413 names the one that
    applies)."""
    files = config.max_file_bytes
    upload = Limit(
        files + FORM_BYTES,
        f"an upload: a file of at most {files:,} bytes, TOKENFLEET_GATEWAY_MAX_FILE_BYTES, "
        f"plus {FORM_BYTES:,} for the form",
        code="file_too_large",
        param="file",
    )
    return upload if upload.max_bytes >= config.max_body_bytes else Limit(config.max_body_bytes)


# ---- errors: every one an OpenAI-style error body --------------------------------------


def add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(_request: Request, exc: ApiError) -> Response:
        return error_response(exc)

    @app.exception_handler(NotFound)
    async def missing(_request: Request, exc: NotFound) -> Response:
        return error_response(not_found(exc))

    @app.exception_handler(RequestValidationError)
    async def invalid(_request: Request, exc: RequestValidationError) -> Response:
        problems = [f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()[:5]]
        return error_response(ApiError(400, "; ".join(problems), code="invalid_value"))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> Response:
        return error_response(routing_error(request, exc))

    @app.exception_handler(RedisError)
    async def redis_unavailable(_request: Request, exc: RedisError) -> Response:
        return error_response(redis_down(exc))


def routing_error(request: Request, exc: HTTPException) -> ApiError:
    """Starlette's 404 (no route matched) and 405 (the path did, not the method) as
    OpenAI-style errors naming what was asked and what is served."""
    asked = f"{request.method} {request.url.path}"
    headers = dict(exc.headers or {})
    if exc.status_code == 404:
        served = ", ".join(served_routes(request.app))
        return ApiError(404, f"no route {asked}; the gateway serves {served}", code="unknown_route")
    if exc.status_code == 405:
        allowed = headers.get("Allow", "")
        return ApiError(
            405,
            f"method {request.method} is not allowed on {request.url.path}; allowed: {allowed}",
            code="method_not_allowed",
            headers=headers,
        )
    return ApiError(exc.status_code, str(exc.detail), headers=headers)


def served_routes(app: FastAPI) -> list[str]:
    """'METHOD /path' of every route, in the order they were added."""
    return _routes(app.routes, "")


def _routes(routes: Sequence[Any], prefix: str) -> list[str]:
    out = []
    for route in routes:
        included = getattr(route, "original_router", None)  # an included router (FastAPI)
        if included is not None:
            out += _routes(included.routes, prefix + route.include_context.prefix)
            continue
        methods = sorted(set(getattr(route, "methods", None) or ()) - {"HEAD"})
        out += [f"{method} {prefix}{getattr(route, 'path', '?')}" for method in methods]
    return out


# ---- routes ----------------------------------------------------------------------------


def gateway_of(request: Request) -> Gateway:
    gw: Gateway = request.app.state.gateway
    return gw


def completion_routes(authed: Sequence[Any]) -> APIRouter:
    """/v1/completions and /v1/chat/completions: one job each (`Gateway.generate`)."""
    api = APIRouter(dependencies=authed)

    @api.post("/v1/completions", response_model=None)
    async def completions(request: Request) -> Response:
        return await gateway_of(request).generate(request, "completions")

    @api.post("/v1/chat/completions", response_model=None)
    async def chat_completions(request: Request) -> Response:
        return await gateway_of(request).generate(request, "chat")

    @api.post("/v1/embeddings", response_model=None)
    async def embeddings(request: Request) -> Response:
        """Not a missing route but a missing capability: say so (OpenAI's clients would
        read a 404 as a wrong base URL)."""
        served = sorted((await gateway_of(request).fleet.read()).models)
        raise ApiError(
            400,
            f"the fleet's models ({', '.join(served) or 'none live'}) generate text and "
            "serve no embeddings: use /v1/completions or /v1/chat/completions",
            param="model",
            code="model_not_embedding",
        )

    return api


def model_card(served: ServedModel) -> ModelCard:
    return ModelCard(
        id=served.name,
        created=served.created,
        workers=len(served.workers),
        checkpoints=served.checkpoints,
        max_job_tokens=served.max_job_tokens,
    )


def fleet_routes(authed: Sequence[Any], metrics: GatewayMetrics) -> APIRouter:
    """What the fleet serves (/v1/models, behind the key check), and the operator's
    /health and /metrics."""
    api = APIRouter()

    @api.get("/v1/models", dependencies=list(authed))
    async def models(request: Request) -> ModelList:
        view = await gateway_of(request).fleet.read(fresh=True)
        return ModelList(data=[model_card(m) for m in view.models.values()])

    @api.get("/v1/models/{model_id}", dependencies=list(authed))
    async def model(request: Request, model_id: str) -> ModelCard:
        served = (await gateway_of(request).fleet.read(fresh=True)).models
        if model_id not in served:
            raise ApiError(
                404,
                f"the model {model_id!r} is not served by any live worker; "
                f"served: {', '.join(sorted(served)) or 'none'}",
                param="model",
                code="model_not_found",
            )
        return model_card(served[model_id])

    @api.get("/health")
    async def health(request: Request) -> Response:
        gw = gateway_of(request)
        try:
            await gw.redis.ping()
            view = await gw.fleet.read(fresh=True)
        except RedisError as exc:
            body = {"status": "unavailable", "redis": False, "error": str(exc), "live_workers": 0}
            return JSONResponse(body, status_code=503)
        return JSONResponse(
            {
                "status": "ok",
                "redis": True,
                "live_workers": len(view.workers),
                "models": sorted(view.models),
                "pubsub": {
                    "connections": gw.subscriber.connected,
                    "of": gw.subscriber.shards,
                    "streams": gw.subscriber.watched,
                },
            }
        )

    @api.get("/metrics")
    async def prometheus(request: Request) -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST

        gw = gateway_of(request)
        await metrics.refresh_fleet(gw.redis, gw.keys, gw.fleet)  # the fleet-wide gauges
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return api
