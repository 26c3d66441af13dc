"""The gateway's FastAPI app: routes, API keys, error bodies, metrics.

`create_app(settings)` builds it; `service.Gateway` does the work of each
completion request. docs/http.md is the reference for clients.
"""

from __future__ import annotations

import hmac
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import redis.asyncio as aredis
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from redis.exceptions import RedisError
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse, Response

from tokenfleet.config import Settings
from tokenfleet.gateway.errors import ApiError, unauthorized
from tokenfleet.gateway.metrics import GatewayMetrics, RequestCounter
from tokenfleet.gateway.openai_models import ModelCard, ModelList
from tokenfleet.gateway.service import Gateway, GatewayConfig, redis_down


def create_app(settings: GatewayConfig | Settings) -> FastAPI:
    """The gateway's FastAPI app. Redis is connected on startup, closed on shutdown."""
    config = (
        settings if isinstance(settings, GatewayConfig) else GatewayConfig.from_settings(settings)
    )
    metrics = GatewayMetrics()
    keys = [key.encode() for key in config.api_keys]

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        client = aredis.Redis.from_url(config.redis_url, health_check_interval=10)
        app.state.gateway = Gateway(config, client, metrics)
        try:
            yield
        finally:
            await client.aclose()

    def gateway_of(request: Request) -> Gateway:
        gw: Gateway = request.app.state.gateway
        return gw

    async def require_key(request: Request) -> None:
        if not keys:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise unauthorized("missing API key: send 'Authorization: Bearer <key>'")
        given = token.strip().encode()
        # compare with every key, always: the time taken says nothing about which matched
        matched = False
        for key in keys:
            matched |= hmac.compare_digest(given, key)
        if not matched:
            raise unauthorized("invalid API key")

    app = FastAPI(
        title="tokenfleet gateway",
        summary="OpenAI-compatible completions served by a tokenfleet fleet",
        lifespan=lifespan,
        docs_url=None,  # bodies are parsed by hand (OpenAI-style errors): no useful schema
        redoc_url=None,
        openapi_url=None,
    )
    app.add_middleware(RequestCounter, metrics=metrics)
    authed = [Depends(require_key)]

    @app.exception_handler(ApiError)
    async def api_error(_request: Request, exc: ApiError) -> Response:
        return exc.response()

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
            }
        )

    @app.get("/metrics")
    async def prometheus() -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app
