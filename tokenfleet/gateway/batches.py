"""/v1/files and /v1/batches in OpenAI's shapes, over `tokenfleet.batch` (docs/http.md).

The routes only read and write the batch's state in Redis; the gateway's `BatchDriver`
(any replica's) runs the batch, at batch priority, for the tenant of the API key that
created it. Files and batches belong to that tenant: another tenant's key gets 404 for
them and never sees them listed. A request's inputs are pydantic models (`FileUpload`,
`BatchRequest`, `BatchPage`); what they refuse is a 400 naming the parameter, in the
order the fields are declared."""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Query, Request
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    ValidationError,
    field_validator,
)
from starlette.datastructures import UploadFile
from starlette.responses import JSONResponse, Response

from tokenfleet.batch.format import ENDPOINTS
from tokenfleet.batch.store import TERMINAL, BatchStore, FileTooLarge, NotFound, new_id
from tokenfleet.gateway.auth import caller_of
from tokenfleet.openai.errors import ApiError

COMPLETION_WINDOWS = {"24h": 24 * 3600}
MAX_METADATA = 16

__all__ = ["not_found", "router"]


def not_found(exc: NotFound) -> ApiError:
    """A file or batch that does not exist (the app's handler for NotFound)."""
    return ApiError(404, str(exc.args[0]), code="not_found")


def router(dependencies: Sequence[Any]) -> APIRouter:
    """The routes, behind `dependencies` (the API key check)."""
    api = APIRouter(dependencies=list(dependencies))
    api.add_api_route("/v1/files", create_file, methods=["POST"])
    api.add_api_route("/v1/files", list_files, methods=["GET"])
    api.add_api_route("/v1/files/{file_id}", get_file, methods=["GET"])
    api.add_api_route("/v1/files/{file_id}/content", file_content, methods=["GET"])
    api.add_api_route("/v1/files/{file_id}", delete_file, methods=["DELETE"])
    api.add_api_route("/v1/batches", create_batch, methods=["POST"])
    api.add_api_route("/v1/batches/{batch_id}", get_batch, methods=["GET"])
    api.add_api_route("/v1/batches", list_batches, methods=["GET"])
    api.add_api_route("/v1/batches/{batch_id}/cancel", cancel_batch, methods=["POST"])
    return api


def store_of(request: Request) -> BatchStore:
    store: BatchStore = request.app.state.batch_store
    return store


def tenant_of(request: Request) -> str:
    """The tenant of the request's API key (the router's key check ran first)."""
    return caller_of(request).tenant


Store = Annotated[BatchStore, Depends(store_of)]
Tenant = Annotated[str, Depends(tenant_of)]


# ---- the inputs ------------------------------------------------------------------------


class FileUpload(BaseModel):
    """The multipart form of POST /v1/files."""

    model_config = ConfigDict(arbitrary_types_allowed=True, frozen=True)

    purpose: Literal["batch"]
    file: UploadFile

    @classmethod
    def from_form(cls, form: Mapping[str, Any]) -> FileUpload:
        fields = {"purpose": form.get("purpose"), "file": form.get("file")}
        try:
            return cls.model_validate(fields)
        except ValidationError as exc:
            if first_refused(cls, exc) == "purpose":
                message = f"purpose must be 'batch', got {fields['purpose']!r}"
                raise ApiError(400, message, param="purpose", code="invalid_value") from None
            message = "send the file as multipart field 'file'"
            raise ApiError(400, message, param="file", code="missing_required_parameter") from None


Metadata = Annotated[
    dict[
        Annotated[str, StringConstraints(max_length=64)],
        Annotated[str, StringConstraints(max_length=512)],
    ],
    Field(max_length=MAX_METADATA),
]


class BatchRequest(BaseModel):
    """The JSON body of POST /v1/batches."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    endpoint: str
    completion_window: str
    metadata: Metadata | None = None  # none (or empty): no metadata
    input_file_id: str

    @field_validator("endpoint")
    @classmethod
    def _served(cls, endpoint: str) -> str:
        if endpoint not in ENDPOINTS:
            raise ValueError(endpoint)
        return endpoint

    @field_validator("completion_window")
    @classmethod
    def _known_window(cls, window: str) -> str:
        if window not in COMPLETION_WINDOWS:
            raise ValueError(window)
        return window

    @field_validator("metadata", mode="before")
    @classmethod
    def _empty_is_none(cls, metadata: Any) -> Any:
        return metadata or None

    @classmethod
    def from_body(cls, body: bytes) -> BatchRequest:
        """The body parsed; a 400 for the first thing wrong with it, unknown parameters
        first. (json's own message says where a body that is not JSON goes wrong.)"""
        try:
            raw = json.loads(body)
        except ValueError as exc:
            raise ApiError(400, f"the body is not JSON: {exc}", code="invalid_json") from None
        try:
            return cls.model_validate(raw)
        except ValidationError as exc:
            raise cls._refusal(exc) from None

    @classmethod
    def _refusal(cls, exc: ValidationError) -> ApiError:
        unknown = sorted(str(e["loc"][0]) for e in exc.errors() if e["type"] == "extra_forbidden")
        if unknown:
            return ApiError(
                400, f"unknown parameter {unknown[0]!r}", param=unknown[0], code="unknown_parameter"
            )
        name = first_refused(cls, exc)
        if name is None:
            return ApiError(400, "the body must be a JSON object", code="invalid_value")
        message, code = {
            "endpoint": (f"endpoint must be one of {', '.join(ENDPOINTS)}", "invalid_value"),
            "completion_window": ("completion_window must be '24h'", "invalid_value"),
            "metadata": (
                f"metadata: at most {MAX_METADATA} string pairs (keys ≤ 64, values ≤ 512)",
                "invalid_value",
            ),
            "input_file_id": ("input_file_id is required", "missing_required_parameter"),
        }[name]
        return ApiError(400, message, param=name, code=code)


class BatchPage(BaseModel):
    """The query of GET /v1/batches: up to `limit` (1 … 100) batches after `after`."""

    limit: int = 20
    after: str | None = None

    @property
    def size(self) -> int:
        return max(1, min(self.limit, 100))


def first_refused(model: type[BaseModel], exc: ValidationError) -> str | None:
    """The first of `model`'s fields, in declaration order, that `exc` refuses; None
    when it refuses the input as a whole (not an object)."""
    refused = {str(e["loc"][0]) for e in exc.errors() if e["loc"]}
    return next((name for name in model.model_fields if name in refused), None)


# ---- the outputs -----------------------------------------------------------------------


class RequestCounts(BaseModel):
    total: int = 0
    completed: int = 0
    failed: int = 0


class BatchObject(BaseModel):
    """A batch as OpenAI shows it, as it is created; the driver moves it on from here."""

    id: str
    object: Literal["batch"] = "batch"
    endpoint: str
    errors: None = None
    input_file_id: str
    completion_window: str
    status: str = "validating"
    output_file_id: str | None = None
    error_file_id: str | None = None
    created_at: int
    in_progress_at: int | None = None
    expires_at: int
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    request_counts: RequestCounts = Field(default_factory=RequestCounts)
    metadata: dict[str, str] | None = None

    @classmethod
    def new(cls, request: BatchRequest) -> BatchObject:
        created = int(time.time())
        return cls(
            id=new_id("batch"),
            endpoint=request.endpoint,
            input_file_id=request.input_file_id,
            completion_window=request.completion_window,
            created_at=created,
            expires_at=created + COMPLETION_WINDOWS[request.completion_window],
            metadata=request.metadata,
        )


def _public(doc: dict[str, Any]) -> dict[str, Any]:
    """The file or batch object without tokenfleet's own fields."""
    return {k: v for k, v in doc.items() if not k.startswith("tokenfleet_")}


# ---- files -----------------------------------------------------------------------------


async def create_file(request: Request, store: Store, tenant: Tenant) -> JSONResponse:
    upload = FileUpload.from_form(await request.form())
    content = await upload.file.read()
    name = upload.file.filename or "upload.jsonl"
    try:
        doc = await store.put_file(content, name, upload.purpose, tenant)
    except FileTooLarge as exc:
        raise ApiError(413, str(exc), param="file", code="file_too_large") from None
    return JSONResponse(_public(doc))


async def list_files(store: Store, tenant: Tenant) -> JSONResponse:
    docs = [_public(d) for d in await store.files(tenant)]
    return JSONResponse({"object": "list", "data": docs, "has_more": False})


async def get_file(file_id: str, store: Store, tenant: Tenant) -> JSONResponse:
    return JSONResponse(_public(await store.file(file_id, tenant)))


async def file_content(file_id: str, store: Store, tenant: Tenant) -> Response:
    data = await store.content(file_id, tenant)
    return Response(data, media_type="application/jsonl")


async def delete_file(file_id: str, store: Store, tenant: Tenant) -> JSONResponse:
    if not await store.delete_file(file_id, tenant):
        raise NotFound(f"no file {file_id!r}")
    return JSONResponse({"id": file_id, "object": "file", "deleted": True})


# ---- batches ---------------------------------------------------------------------------


async def create_batch(request: Request, store: Store, tenant: Tenant) -> JSONResponse:
    asked = BatchRequest.from_body(await request.body())
    source = await store.file(asked.input_file_id, tenant)
    if source["purpose"] != "batch":
        raise ApiError(
            400,
            f"file {asked.input_file_id!r} has purpose {source['purpose']!r}, not 'batch'",
            param="input_file_id",
            code="invalid_value",
        )
    doc = BatchObject.new(asked).model_dump(mode="json")
    await store.create_batch(doc, tenant=tenant)
    return JSONResponse(doc)


async def get_batch(batch_id: str, store: Store, tenant: Tenant) -> JSONResponse:
    return JSONResponse(_public(await store.batch(batch_id, tenant)))


async def list_batches(
    page: Annotated[BatchPage, Query()], store: Store, tenant: Tenant
) -> JSONResponse:
    docs = await store.batches(tenant, page.size + 1, page.after)
    shown = [_public(d) for d in docs[: page.size]]
    return JSONResponse(
        {
            "object": "list",
            "data": shown,
            "first_id": shown[0]["id"] if shown else None,
            "last_id": shown[-1]["id"] if shown else None,
            "has_more": len(docs) > page.size,
        }
    )


async def cancel_batch(batch_id: str, store: Store, tenant: Tenant) -> JSONResponse:
    doc = await store.batch(batch_id, tenant)
    if doc["status"] in TERMINAL:
        raise ApiError(
            409, f"batch {batch_id!r} is {doc['status']} already", code="batch_not_cancellable"
        )
    await store.request_cancel(batch_id)
    if doc["status"] != "cancelling":  # what the driver does next; it saves it too
        doc["status"], doc["cancelling_at"] = "cancelling", int(time.time())
    return JSONResponse(_public(doc))
