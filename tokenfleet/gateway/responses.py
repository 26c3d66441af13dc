"""An `ApiError` as the HTTP response the gateway sends."""

from __future__ import annotations

from starlette.responses import JSONResponse

from tokenfleet.openai.errors import ApiError


def error_response(err: ApiError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)
