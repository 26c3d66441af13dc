"""The gateway's FastAPI app: routes, API keys, error bodies, metrics.

`create_app(settings)` builds it; `service.Gateway` does the work of each
completion request; `auth.KeyCheck` says which API key (tenant, default priority)
sent it. Redis is reached through one bounded pool of command
connections that requests wait for (never "Too many connections") and the
`Subscriber`'s few pub/sub connections, which every stream shares. docs/http.md
is the reference for clients.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import redis.asyncio as aredis
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from redis.exceptions import RedisError
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse, Response

from tokenfleet.config import Settings
from tokenfleet.gateway.auth import KeyCheck
from tokenfleet.gateway.errors import ApiError
from tokenfleet.gateway.limits import BodyLimit, Limit
from tokenfleet.gateway.metrics import GatewayMetrics, RequestCounter
from tokenfleet.gateway.openai_models import ModelCard, ModelList
from tokenfleet.gateway.service import Gateway, GatewayConfig, redis_down
from tokenfleet.gateway.subscriber import Subscriber

CLIENT_NAME = "tokenfleet-gateway"  # the command connections, in CLIENT LIST
FORM_BYTES = 64 * 1024  # what an upload's multipart form may add around its file


def create_app(settings: GatewayConfig | Settings) -> FastAPI:
    """The gateway's FastAPI app. Redis is connected on startup, closed on shutdown."""
    # here, not at the top: tokenfleet.batch uses this package's models and errors
    from tokenfleet.batch.driver import BatchDriver, DriverConfig
    from tokenfleet.batch.store import BatchStore, NotFound
    from tokenfleet.gateway.batches import not_found
    from tokenfleet.gateway.batches import router as batches_router

    config = (
        settings if isinstance(settings, GatewayConfig) else GatewayConfig.from_settings(settings)
    )
    metrics = GatewayMetrics()
    require_key = KeyCheck(config.parsed_keys)  # leaves request.state.caller

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        pool = aredis.BlockingConnectionPool.from_url(
            config.redis_url,
            max_connections=config.redis_connections,
            timeout=config.redis_wait_s,
            health_check_interval=10,
            client_name=CLIENT_NAME,
        )
        client = aredis.Redis(connection_pool=pool)
        subscriber = Subscriber(pool, shards=config.pubsub_connections)
        subscriber.start()
        gw = Gateway(config, client, metrics, subscriber)
        app.state.batch_store = BatchStore(
            client,
            gw.keys,
            max_file_bytes=config.max_file_bytes,
            lease_ms=int(config.batch_lease_s * 1000),
        )
        driver_task = None
        if config.batches:
            driver = BatchDriver(
                app.state.batch_store,
                gw.producer,
                DriverConfig(
                    max_in_flight=config.batch_max_in_flight,
                    queue_share=config.batch_queue_share,
                    chat_max_tokens=config.default_max_tokens,
                ),
            )
            driver_task = asyncio.create_task(driver.run())
        metrics.watch("live_streams", lambda: subscriber.watched)
        metrics.watch("pubsub_connections", lambda: subscriber.connected)
        metrics.watch("pubsub_reconnects", lambda: subscriber.reconnects)
        metrics.watch("cancel_retries", lambda: gw.canceller.pending)
        app.state.gateway = gw
        try:
            yield
        finally:
            if driver_task is not None:
                driver_task.cancel()
                with contextlib.suppress(BaseException):
                    await driver_task
            await gw.canceller.aclose()
            await subscriber.aclose()
            await client.aclose()
            await pool.aclose()

    def gateway_of(request: Request) -> Gateway:
        gw: Gateway = request.app.state.gateway
        return gw

    app = FastAPI(
        title="tokenfleet gateway",
        summary="OpenAI-compatible completions served by a tokenfleet fleet",
        lifespan=lifespan,
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
    authed = [Depends(require_key)]

    @app.exception_handler(ApiError)
    async def api_error(_request: Request, exc: ApiError) -> Response:
        return exc.response()

    @app.exception_handler(NotFound)
    async def missing(_request: Request, exc: NotFound) -> Response:
        return not_found(exc).response()

    @app.exception_handler(RequestValidationError)
    async def invalid(_request: Request, exc: RequestValidationError) -> Response:
        problems = [f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()[:5]]
        return ApiError(400, "; ".join(problems), code="invalid_value").response()

    @app.exception_handler(HTTPException)
    async def http_error(_request: Request, exc: HTTPException) -> Response:
        return ApiError(exc.status_code, str(exc.detail), code=None).response()

    @app.exception_handler(RedisError)
    async def redis_unavailable(_request: Request, exc: RedisError) -> Response:
        return redis_down(exc).response()

    @app.post("/v1/completions", dependencies=authed, response_model=None)
    async def completions(request: Request) -> Response:
        return await gateway_of(request).generate(request, "completions")

    @app.post("/v1/chat/completions", dependencies=authed, response_model=None)
    async def chat_completions(request: Request) -> Response:
        return await gateway_of(request).generate(request, "chat")

    @app.get("/v1/models", dependencies=authed)
    async def models(request: Request) -> ModelList:
        view = await gateway_of(request).fleet.read(fresh=True)
        return ModelList(
            data=[
                ModelCard(
                    id=m.name,
                    created=m.created,
                    workers=len(m.workers),
                    checkpoints=m.checkpoints,
                    max_job_tokens=m.max_job_tokens,
                )
                for m in view.models.values()
            ]
        )

    @app.get("/health")
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

    app.include_router(batches_router(lambda request: request.app.state.batch_store, authed))

    @app.get("/metrics")
    async def prometheus(request: Request) -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST

        gw = gateway_of(request)
        await metrics.refresh_fleet(gw.redis, gw.keys)  # the fleet-wide gauges, from Redis
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app


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
