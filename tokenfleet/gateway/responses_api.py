"""OpenAI's Responses API over the fleet: `POST /v1/responses` (one job, through the same
`Gateway.serve` as a chat completion: the request is translated into a chat request,
openai/responses.py), `GET` / `DELETE /v1/responses/ID` (the store,
gateway/response_store.py) and `POST /v1/responses/ID/cancel` (the running job).

`ResponsesOutput` is how the job is shown: one `Response` body, or OpenAI's event stream
(`ResponseEvents`); with `store` (the default) the finished response and its conversation
are stored before the last bytes go out, so a `GET` or a `previous_response_id` right
after the answer finds them. docs/http.md, "Responses API", is the reference.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter
from pydantic import ValidationError
from redis.exceptions import RedisError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from tokenfleet.batch.store import NotFound
from tokenfleet.gateway.auth import caller_of
from tokenfleet.gateway.output import Output
from tokenfleet.gateway.response_store import ResponseStore, StoredResponse
from tokenfleet.gateway.service import Gateway
from tokenfleet.openai.errors import ApiError, from_validation
from tokenfleet.openai.models import ChatCompletionRequest
from tokenfleet.openai.responses import (
    REFUSED,
    Call,
    InputItem,
    ResponseEvents,
    ResponseObject,
    ResponsesRequest,
    answered,
    chat_fields,
    clean_param,
    dump_items,
    history_of,
    job_of,
    responses_param,
    skeleton,
)
from tokenfleet.protocol import FinishEvent, FunctionTool, ToolCall
from tokenfleet.tools import DEFAULT_FORMAT, CallStream, ToolFormat, split_calls

log = logging.getLogger(__name__)


def router(dependencies: Sequence[Any]) -> APIRouter:
    """The routes, behind `dependencies` (the API key check)."""
    api = APIRouter(dependencies=list(dependencies))
    api.add_api_route("/v1/responses", create, methods=["POST"], response_model=None)
    api.add_api_route("/v1/responses/{response_id}", retrieve, methods=["GET"])
    api.add_api_route("/v1/responses/{response_id}", delete, methods=["DELETE"])
    api.add_api_route("/v1/responses/{response_id}/cancel", cancel, methods=["POST"])
    return api


def _gateway(request: Request) -> Gateway:
    gw: Gateway = request.app.state.gateway
    return gw


def _store(gw: Gateway) -> ResponseStore:
    return ResponseStore(gw.redis, gw.keys, gw.config.response_ttl_s)


def _not_found(response_id: str) -> ApiError:
    return ApiError(404, f"no response {response_id!r}", param="response_id", code="not_found")


# ---- POST /v1/responses -----------------------------------------------------------------


async def create(request: Request) -> Response:
    arrived = time.monotonic()
    gw = _gateway(request)
    tenant = caller_of(request).tenant
    parsed = parse(await request.body())
    store = _store(gw)
    history: list[InputItem] = []
    if parsed.previous_response_id is not None:
        try:
            previous = await store.get(parsed.previous_response_id, tenant)
        except NotFound:
            raise ApiError(
                404,
                f"no stored response {parsed.previous_response_id!r} (never stored, "
                "deleted, expired, or made with store: false)",
                param="previous_response_id",
                code="previous_response_not_found",
            ) from None
        history = history_of(previous.input, previous.response.output)
    conversation = [*history, *parsed.items]
    chat = to_chat(parsed, history)
    tools = chat.callable_tools()
    fmt = await _tool_format(gw, parsed.model) if tools else DEFAULT_FORMAT

    def output(job_id: str, service_tier: str) -> Output:
        calls = Calls(fmt, tools, job_id) if tools else None
        kept = store if parsed.store else None
        return ResponsesOutput(parsed, conversation, job_id, service_tier, kept, tenant, calls)

    return await gw.serve(request, chat, "chat", arrived, output)


async def _tool_format(gw: Gateway, model: str) -> ToolFormat:
    """How the model's workers write tool calls (what the answer is read back with)."""
    served = (await gw.fleet.read()).models.get(model)
    advertised = served.tool_format if served is not None else None
    return ToolFormat(advertised) if advertised in set(ToolFormat) else DEFAULT_FORMAT


@dataclass(frozen=True)
class Calls:
    """The functions an answer may call, and how its model writes the calls."""

    fmt: ToolFormat
    tools: list[FunctionTool]
    job_id: str

    def split(self, text: str) -> tuple[str | None, list[Call]]:
        found = split_calls(self.fmt, text, self.tools, self.job_id)
        return (found.content if found.calls else text), _calls(found.calls)

    def stream(self) -> CallStream:
        return CallStream(self.fmt, self.tools, self.job_id)


def _calls(calls: list[ToolCall]) -> list[Call]:
    return [Call(call_id=c.id, name=c.name, arguments=c.arguments) for c in calls]


def parse(body: bytes) -> ResponsesRequest:
    """The request; a 400 naming the field (one OpenAI defines and the fleet does not
    serve says why: `REFUSED`)."""
    try:
        return ResponsesRequest.model_validate_json(body)
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        name = str(first["loc"][0]) if first["loc"] else ""
        if first["type"] == "extra_forbidden" and name in REFUSED:
            message = f"{name}: not supported: {REFUSED[name]}"
            raise ApiError(400, message, param=name, code="unsupported_parameter") from None
        error = from_validation(exc)
        param = error.detail.param
        raise ApiError(
            400,
            clean_param(error.detail.message),
            param=None if param is None else clean_param(param),
            code=error.detail.code,
        ) from None


def to_chat(parsed: ResponsesRequest, history: list[InputItem]) -> ChatCompletionRequest:
    """The chat request that runs it; its refusals name the Responses fields."""
    try:
        return ChatCompletionRequest.model_validate(chat_fields(parsed, history))
    except ValidationError as exc:
        error = from_validation(exc)
        detail = error.detail
        raise ApiError(
            error.status,
            detail.message,
            param=responses_param(detail.param),
            code=detail.code,
        ) from None


class ResponsesOutput:
    """One response as `Gateway.serve` shows it (gateway/output.py's `Output`)."""

    def __init__(
        self,
        request: ResponsesRequest,
        conversation: list[InputItem],
        job_id: str,
        service_tier: str,
        store: ResponseStore | None,
        tenant: str,
        calls: Calls | None = None,
    ) -> None:
        self.request = request
        self.conversation = conversation
        self.job_id = job_id
        self.store = store
        self.tenant = tenant
        start = skeleton(request, job_id, int(time.time()), service_tier)
        self.events = ResponseEvents(start, job_id)
        self.calls = calls
        # with tools, text that may turn out to be a call is held back until it is known
        self._held = calls.stream() if calls is not None else None

    def opening(self) -> bytes:
        return self.events.opening()

    def delta(self, text: str) -> bytes:
        if self._held is not None:
            text = self._held.feed(text)
        return self.events.text(text) if text else b""

    async def ended(self, finish: FinishEvent, include_usage: bool) -> bytes:
        out, calls = b"", []
        if self._held is not None:
            rest, found = self._held.finish()
            out, calls = (self.events.text(rest) if rest else b""), _calls(found)
        out += self.events.ending(finish, calls, message=not calls)
        await self._keep()
        return out

    async def failed(self, error: ApiError) -> bytes:
        out = self.events.failed(_response_code(error), error.detail.message)
        await self._keep()
        return out

    async def answer(self, text: str, finish: FinishEvent) -> dict[str, Any]:
        content, calls = self.calls.split(text) if self.calls is not None else (text, [])
        self.events.response = answered(self.events.response, self.job_id, content, calls, finish)
        await self._keep()
        return self.events.response.model_dump(mode="json")

    async def _keep(self) -> None:
        """Store the response (with `store`), before its last bytes go out. A store that
        fails is logged: the client still gets its answer."""
        if self.store is None:
            return
        stored = StoredResponse(
            tenant=self.tenant,
            job_id=self.job_id,
            response=self.events.response,
            input=dump_items(self.conversation),
        )
        try:
            await self.store.put(stored)
        except RedisError as exc:
            log.warning("could not store response %s: %s", stored.response.id, exc)


def _response_code(error: ApiError) -> str:
    """An error as one of the codes OpenAI's `ResponseError` allows (ours is in the
    message): server_error, rate_limit_exceeded, or invalid_prompt for the request's own
    fault."""
    if error.status == 429:
        return "rate_limit_exceeded"
    return "server_error" if error.status >= 500 else "invalid_prompt"


# ---- the stored responses ---------------------------------------------------------------


async def retrieve(response_id: str, request: Request) -> Response:
    gw = _gateway(request)
    try:
        stored = await _store(gw).get(response_id, caller_of(request).tenant)
    except NotFound:
        raise _not_found(response_id) from None
    return JSONResponse(stored.response.model_dump(mode="json"))


async def delete(response_id: str, request: Request) -> Response:
    gw = _gateway(request)
    try:
        await _store(gw).delete(response_id, caller_of(request).tenant)
    except NotFound:
        raise _not_found(response_id) from None
    return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})


async def cancel(response_id: str, request: Request) -> Response:
    """Cancel a response still being generated (streamed, or waited for): its job is
    cancelled in the fleet and the request that waits for it ends `cancelled` (and is
    stored so, with `store`). A finished one is a 400; another tenant's, a 404."""
    gw = _gateway(request)
    tenant = caller_of(request).tenant
    try:
        stored = await _store(gw).get(response_id, tenant)
    except NotFound:
        stored = None
    if stored is not None:
        raise ApiError(
            400,
            f"response {response_id!r} is not running (it is {stored.response.status}): "
            "only a response still being generated can be cancelled",
            param="response_id",
            code="response_not_running",
        )
    job_id = job_of(response_id)
    if job_id is None:
        raise _not_found(response_id)
    status, owner, model, submitted = await gw.redis.hmget(
        gw.keys.job(job_id), ["status", "tenant", "model", "submitted_at"]
    )
    if status is None or (owner or b"default").decode() != tenant:
        raise _not_found(response_id)
    if status not in (b"queued", b"running"):
        raise ApiError(
            400,
            f"response {response_id!r} is not running (its job is {status.decode()})",
            param="response_id",
            code="response_not_running",
        )
    await gw.canceller.cancel(gw.producer.handle(job_id))
    body = ResponseObject(
        id=response_id,
        created_at=int(float(submitted or 0)),
        status="cancelled",
        model=(model or b"default").decode() or "default",
    )
    return JSONResponse(body.model_dump(mode="json"))
