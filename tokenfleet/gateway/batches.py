"""/v1/files and /v1/batches in OpenAI's shapes, over `tokenfleet.batch` (docs/http.md).

The routes only read and write the batch's state in Redis; the gateway's `BatchDriver`
(any replica's) runs the batch, at batch priority, for the tenant of the API key that
created it. Files and batches belong to that tenant: another tenant's key gets 404 for
them and never sees them listed."""

from __future__ import annotations

import json
import time
from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import JSONResponse, Response

from tokenfleet.batch.format import ENDPOINTS
from tokenfleet.batch.store import TERMINAL, BatchStore, FileTooLarge, NotFound, new_id
from tokenfleet.gateway.auth import caller_of
from tokenfleet.gateway.errors import ApiError

COMPLETION_WINDOWS = {"24h": 24 * 3600}
FILE_PURPOSES = ("batch", "batch_output")
MAX_METADATA = 16


def not_found(exc: NotFound) -> ApiError:
    """A file or batch that does not exist (the app's handler for NotFound)."""
    return ApiError(404, str(exc.args[0]), code="not_found")


def router(store_of: Any, dependencies: list[Any]) -> APIRouter:
    """The routes; `store_of(request)` gives the app's `BatchStore`."""
    api = APIRouter(dependencies=dependencies)

    def store(request: Request) -> BatchStore:
        s: BatchStore = store_of(request)
        return s

    # ---- files --------------------------------------------------------------------

    @api.post("/v1/files")
    async def create_file(request: Request) -> JSONResponse:
        s = store(request)
        form = await request.form()
        upload, purpose = form.get("file"), form.get("purpose")
        if purpose not in ("batch",):
            raise ApiError(
                400,
                f"purpose must be 'batch', got {purpose!r}",
                param="purpose",
                code="invalid_value",
            )
        if upload is None or isinstance(upload, str):
            raise ApiError(
                400,
                "send the file as multipart field 'file'",
                param="file",
                code="missing_required_parameter",
            )
        content = await upload.read()
        name = upload.filename or "upload.jsonl"
        try:
            doc = await s.put_file(content, name, str(purpose), caller_of(request).tenant)
        except FileTooLarge as exc:
            raise ApiError(413, str(exc), param="file", code="file_too_large") from None
        return JSONResponse(_public(doc))

    @api.get("/v1/files")
    async def list_files(request: Request) -> JSONResponse:
        s = store(request)
        docs = [_public(d) for d in await s.files(caller_of(request).tenant)]
        return JSONResponse({"object": "list", "data": docs, "has_more": False})

    @api.get("/v1/files/{file_id}")
    async def get_file(file_id: str, request: Request) -> JSONResponse:
        s = store(request)
        return JSONResponse(_public(await s.file(file_id, caller_of(request).tenant)))

    @api.get("/v1/files/{file_id}/content")
    async def file_content(file_id: str, request: Request) -> Response:
        s = store(request)
        data = await s.content(file_id, caller_of(request).tenant)
        return Response(data, media_type="application/jsonl")

    @api.delete("/v1/files/{file_id}")
    async def delete_file(file_id: str, request: Request) -> JSONResponse:
        s = store(request)
        if not await s.delete_file(file_id, caller_of(request).tenant):
            raise NotFound(f"no file {file_id!r}")
        return JSONResponse({"id": file_id, "object": "file", "deleted": True})

    # ---- batches ------------------------------------------------------------------

    @api.post("/v1/batches")
    async def create_batch(request: Request) -> JSONResponse:
        s = store(request)
        try:
            body = json.loads(await request.body())
        except ValueError as exc:
            raise ApiError(400, f"the body is not JSON: {exc}", code="invalid_json") from None
        if not isinstance(body, dict):
            raise ApiError(400, "the body must be a JSON object", code="invalid_value")
        unknown = set(body) - {"input_file_id", "endpoint", "completion_window", "metadata"}
        if unknown:
            raise ApiError(
                400,
                f"unknown parameter {sorted(unknown)[0]!r}",
                param=sorted(unknown)[0],
                code="unknown_parameter",
            )
        endpoint = body.get("endpoint")
        if endpoint not in ENDPOINTS:
            raise ApiError(
                400,
                f"endpoint must be one of {', '.join(ENDPOINTS)}",
                param="endpoint",
                code="invalid_value",
            )
        window = body.get("completion_window")
        if window not in COMPLETION_WINDOWS:
            raise ApiError(
                400,
                "completion_window must be '24h'",
                param="completion_window",
                code="invalid_value",
            )
        metadata = body.get("metadata") or {}
        if (
            not isinstance(metadata, dict)
            or len(metadata) > MAX_METADATA
            or not all(
                isinstance(k, str) and isinstance(v, str) and len(k) <= 64 and len(v) <= 512
                for k, v in metadata.items()
            )
        ):
            raise ApiError(
                400,
                "metadata: at most 16 string pairs (keys ≤ 64, values ≤ 512)",
                param="metadata",
                code="invalid_value",
            )
        input_file_id = body.get("input_file_id")
        if not isinstance(input_file_id, str):
            raise ApiError(
                400,
                "input_file_id is required",
                param="input_file_id",
                code="missing_required_parameter",
            )
        source = await s.file(input_file_id, caller_of(request).tenant)
        if source["purpose"] != "batch":
            raise ApiError(
                400,
                f"file {input_file_id!r} has purpose {source['purpose']!r}, not 'batch'",
                param="input_file_id",
                code="invalid_value",
            )
        created = int(time.time())
        doc: dict[str, Any] = {
            "id": new_id("batch"),
            "object": "batch",
            "endpoint": endpoint,
            "errors": None,
            "input_file_id": input_file_id,
            "completion_window": window,
            "status": "validating",
            "output_file_id": None,
            "error_file_id": None,
            "created_at": created,
            "in_progress_at": None,
            "expires_at": created + COMPLETION_WINDOWS[window],
            "finalizing_at": None,
            "completed_at": None,
            "failed_at": None,
            "expired_at": None,
            "cancelling_at": None,
            "cancelled_at": None,
            "request_counts": {"total": 0, "completed": 0, "failed": 0},
            "metadata": metadata or None,
        }
        await s.create_batch(doc, tenant=caller_of(request).tenant)
        return JSONResponse(doc)

    @api.get("/v1/batches/{batch_id}")
    async def get_batch(batch_id: str, request: Request) -> JSONResponse:
        s = store(request)
        return JSONResponse(_public(await s.batch(batch_id, caller_of(request).tenant)))

    @api.get("/v1/batches")
    async def list_batches(
        request: Request, limit: int = 20, after: str | None = None
    ) -> JSONResponse:
        s = store(request)
        limit = max(1, min(limit, 100))
        docs = await s.batches(caller_of(request).tenant, limit + 1, after)
        page = [_public(d) for d in docs[:limit]]
        return JSONResponse(
            {
                "object": "list",
                "data": page,
                "first_id": page[0]["id"] if page else None,
                "last_id": page[-1]["id"] if page else None,
                "has_more": len(docs) > limit,
            }
        )

    @api.post("/v1/batches/{batch_id}/cancel")
    async def cancel_batch(batch_id: str, request: Request) -> JSONResponse:
        s = store(request)
        doc = await s.batch(batch_id, caller_of(request).tenant)
        if doc["status"] in TERMINAL:
            raise ApiError(
                409, f"batch {batch_id!r} is {doc['status']} already", code="batch_not_cancellable"
            )
        await s.request_cancel(batch_id)
        if doc["status"] != "cancelling":  # what the driver does next; it saves it too
            doc["status"], doc["cancelling_at"] = "cancelling", int(time.time())
        return JSONResponse(_public(doc))

    return api


def _public(doc: dict[str, Any]) -> dict[str, Any]:
    """The file or batch object without tokenfleet's own fields."""
    return {k: v for k, v in doc.items() if not k.startswith("tokenfleet_")}


__all__ = ["not_found", "router"]
