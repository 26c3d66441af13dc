"""Everything that can go wrong, as OpenAI-style HTTP errors.

Every error body is ``{"error": {"message", "type", "param", "code"}}``. The
table in docs/http.md is the reference; `from_finish` is the part of it that
turns a job's terminal event into a status code.
"""

from __future__ import annotations

from pydantic import ValidationError

from tokenfleet.errors import QueueFull, TenantQueueFull
from tokenfleet.grammar import MAX_SCHEMA_DEPTH, GrammarEnd
from tokenfleet.openai.fields import refusal
from tokenfleet.openai.models import ErrorBody, ErrorDetail
from tokenfleet.protocol import FinishEvent, GenerationRequest
from tokenfleet.reasons import AdmissionReason, FinishReason

INVALID = "invalid_request_error"
# pydantic's JSON parser (jiter) refuses a body whose arrays and objects nest deeper
# than this, before any field is read (the OpenAI models cannot change it)
MAX_BODY_DEPTH = 200

_GRAMMAR_ENDS = frozenset(GrammarEnd)

# A job's (GenerationRequest's) field → the OpenAI parameter it came from (for `param`).
# Only a job's errors are renamed: an OpenAI request's own fields keep their names (its
# `metadata` is OpenAI's, not the job's).
_PARAM_OF: dict[tuple[str, ...], str] = {
    ("max_new_tokens",): "max_tokens",
    ("prompt_ids",): "prompt",
    ("metadata", "user"): "user",
}


class ApiError(Exception):
    """An HTTP error with an OpenAI-style body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = INVALID,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.detail = ErrorDetail(message=message, type=type, param=param, code=code)
        self.headers = headers or {}

    def body(self) -> dict[str, object]:
        """The JSON body (the gateway sends it with `status` and `headers`)."""
        return ErrorBody(error=self.detail).model_dump(mode="json")

    def sse(self) -> bytes:
        """The same error as one server-sent event (the OpenAI client raises on it)."""
        return f"data: {ErrorBody(error=self.detail).model_dump_json()}\n\n".encode()


def _param(loc: tuple[int | str, ...], job: bool = False) -> str | None:
    """('messages', 0, 'role') → 'messages[0].role'; for a `job`'s errors, sampling.x → x
    and the protocol's names as OpenAI's (`_PARAM_OF`)."""
    parts = list(loc)
    if job:
        parts = [p for p in parts if p != "sampling"]
        for names, param in _PARAM_OF.items():
            if tuple(map(str, parts[: len(names)])) == names:
                parts = [param, *parts[len(names) :]]
                break
    if not parts:
        return None
    out = str(parts[0])
    for p in parts[1:]:
        out += f"[{p}]" if isinstance(p, int) else f".{p}"
    return out


def from_validation(exc: ValidationError) -> ApiError:
    """A 400 naming the first bad field (a body that is not JSON says so); a field the
    request models do not have is `fields.refusal`'s."""
    errors = exc.errors(include_url=False)
    job = exc.title == GenerationRequest.__name__
    first = errors[0]
    if first["type"] == "json_invalid" and "recursion limit" in str(first["ctx"].get("error")):
        where = str(first["ctx"]["error"]).rpartition(" exceeded ")[2]  # "at line 1 column N"
        return ApiError(
            400,
            f"the body nests deeper than {MAX_BODY_DEPTH} levels of arrays and objects inside "
            f"each other ({where}), the gateway's JSON parser's limit; a response_format schema "
            f"may nest at most MAX_SCHEMA_DEPTH={MAX_SCHEMA_DEPTH} levels",
            code="body_too_deep",
        )
    if first["type"] == "json_invalid":
        return ApiError(
            400,
            f"the body is not valid JSON: {first['ctx'].get('error', first['msg'])}",
            code="invalid_json",
        )
    if first["type"] == "model_type" or (first["type"] == "dict_type" and not first["loc"]):
        return ApiError(400, "the body must be a JSON object", code="invalid_json")
    problems = []
    codes = []
    for err in errors[:5]:
        where = _param(tuple(err["loc"]), job) or "body"
        code, msg = "invalid_value", err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            code, msg = refusal(where)
        elif err["type"] == "missing":
            code = "missing_parameter"
        codes.append(code)
        problems.append(f"{where}: {msg}")
    return ApiError(400, "; ".join(problems), param=_param(tuple(first["loc"]), job), code=codes[0])


def from_finish(finish: FinishEvent, retry_after_s: int) -> ApiError:
    """A job that was rejected or failed, as the HTTP error the client sees."""
    assert finish.reason in (FinishReason.REJECTED, FinishReason.ERROR)
    reason = finish.error.reason if finish.error else str(finish.reason)
    message = finish.error.message if finish.error else f"the job ended as {finish.reason}"
    if reason in _GRAMMAR_ENDS:  # the request's constraint, not the fleet, stopped it
        return ApiError(
            400,
            f"the output does not satisfy the request's structured-output constraint "
            f"(response_format, structured_outputs or a guided_* field): {message}",
            code=reason,
        )
    if finish.reason == FinishReason.ERROR:
        return ApiError(500, f"generation failed: {message}", type="server_error", code=reason)
    if reason == AdmissionReason.REJECTED_QUEUE_FULL:
        return ApiError(
            429,
            f"the worker had no room: {message}",
            type="rate_limit_error",
            code=reason,
            headers={"Retry-After": str(retry_after_s)},
        )
    if reason == AdmissionReason.REJECTED_DUPLICATE:
        return ApiError(409, message, code=reason)
    return ApiError(400, f"the fleet rejected the request ({reason}): {message}", code=reason)


def from_queue_full(exc: QueueFull, model: str, retry_after_s: int) -> ApiError:
    """A submit refused for room: the tenant at its own limit (`tenant_queue_full`: other
    tenants still get in) or the band's stream at its cap (`queue_full`: nobody does)."""
    headers = {"Retry-After": str(retry_after_s)}
    if isinstance(exc, TenantQueueFull):
        return ApiError(
            429,
            f"tenant {exc.tenant!r} is at its limit of queued jobs for model {model!r} "
            f"({exc.depth} queued, limit {exc.cap}): retry later",
            type="rate_limit_error",
            code="tenant_queue_full",
            headers=headers,
        )
    return ApiError(
        429,
        f"the queue for model {model!r} is full ({exc.depth} jobs, cap {exc.cap}): retry later",
        type="rate_limit_error",
        code="queue_full",
        headers=headers,
    )


def unauthorized(message: str) -> ApiError:
    return ApiError(
        401,
        message,
        type="authentication_error",
        code="invalid_api_key",
        headers={"WWW-Authenticate": "Bearer"},
    )
