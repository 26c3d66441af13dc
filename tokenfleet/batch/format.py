"""OpenAI's batch file formats: input lines in, output and error lines out.

An input line is `{"custom_id": ..., "method": "POST", "url": ENDPOINT, "body": {...}}`
with the body of a `/v1/chat/completions` or `/v1/completions` request. A file that is
not such lines (bad JSON, a missing or repeated custom_id, another url or method) fails
the whole batch at validation, as OpenAI's does; a line whose *body* is not a valid
request is one failed request, reported in the error file. Output lines are
`{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}`.

Which file a line lands in (one rule, `result_line`, for the gateway's batches and
`tokenfleet batch run`): a job that ended `stop` or `length`, the model's own ending, is
a success (the output file, counted `completed`). Anything else is an error line
(the error file, counted `failed`): a job the fleet refused or failed (its HTTP error
as the response body), and a job that did not finish, which OpenAI reports with
`"response": null` and an error code: `batch_cancelled` / `batch_expired` when the
batch's cancel or expiry stopped it (`BatchStop`), `request_cancelled` when someone
cancelled the job itself, `request_timeout` past its deadline. Such a job's partial
text is dropped, as OpenAI drops it; the message names the job and how many tokens it
had generated. A line a stopped batch never submitted gets the same code
(`unrun_line`).

Job ids are derived from the batch id and the line number, so a driver that restarts
never submits a line twice: the fleet's submit script refuses a job id it knows.

A batch's jobs wait in the batch priority band (interactive and default work overtakes
them) under the batch's tenant; a line's own `service_tier` / `priority` is ignored.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Literal

from pydantic import ValidationError

from tokenfleet.errors import InvalidRequest, JobRejected
from tokenfleet.fleet import ServedModel
from tokenfleet.keys import DEFAULT_TENANT
from tokenfleet.openai.errors import from_finish
from tokenfleet.openai.models import (
    DEFAULT_COMPLETION_MAX_TOKENS,
    ChatCompletionRequest,
    CompletionRequest,
    job_from_openai,
)
from tokenfleet.openai.render import Renderer, echoes, reads_calls
from tokenfleet.protocol import FinishEvent, GenerationRequest, JobResult, Priority
from tokenfleet.reasons import FinishReason

Kind = Literal["completions", "chat"]
ENDPOINTS: dict[str, Kind] = {"/v1/chat/completions": "chat", "/v1/completions": "completions"}
MAX_CUSTOM_ID_CHARS = 512
MAX_LINES = 50_000  # OpenAI's limit per batch
MAX_REPORTED_ERRORS = 20
DEFAULT_CHAT_MAX_TOKENS = 256  # a chat line that names none (the gateway's default)


class BatchStop(StrEnum):
    """Why a batch stopped before all its lines ran: the error code of each line that
    did not finish (OpenAI's codes for a batch request output's error)."""

    CANCELLED = "batch_cancelled"
    EXPIRED = "batch_expired"

    @property
    def cause(self) -> str:
        if self is BatchStop.CANCELLED:
            return "the batch was cancelled"
        return "the batch expired (its completion window ended)"


SUCCESS = frozenset({FinishReason.STOP, FinishReason.LENGTH})  # the model ended it itself


class BatchInputError(ValueError):
    """The input file cannot be a batch; `errors` in OpenAI's shape (code, message, line)."""

    def __init__(self, errors: list[dict[str, Any]]) -> None:
        self.errors = errors
        first = errors[0]
        more = f" (+{len(errors) - 1} more)" if len(errors) > 1 else ""
        super().__init__(f"line {first.get('line')}: {first['message']}{more}")


@dataclass(frozen=True)
class BatchLine:
    index: int  # 0-based line number among the non-empty lines
    custom_id: str
    kind: Kind
    body: CompletionRequest | ChatCompletionRequest | None  # None: `error` says why
    error: str | None = None


def parse_input(data: bytes, endpoint: str) -> list[BatchLine]:
    """Every request of a batch input file. Raises BatchInputError naming the lines that
    make it unusable (at most MAX_REPORTED_ERRORS of them)."""
    kind = ENDPOINTS.get(endpoint)
    if kind is None:
        raise BatchInputError(
            [
                {
                    "code": "invalid_endpoint",
                    "message": f"endpoint {endpoint!r} is not one of {', '.join(ENDPOINTS)}",
                    "line": None,
                }
            ]
        )
    errors: list[dict[str, Any]] = []
    lines: list[BatchLine] = []
    seen: set[str] = set()

    def fail(number: int, code: str, message: str) -> None:
        if len(errors) < MAX_REPORTED_ERRORS:
            errors.append({"code": code, "message": message, "line": number})

    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BatchInputError(
            [{"code": "invalid_json_line", "message": f"not UTF-8: {exc}", "line": None}]
        ) from None
    for number, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip():
            continue
        try:
            item = json.loads(raw)
        except ValueError as exc:
            fail(number, "invalid_json_line", f"not JSON: {exc}")
            continue
        if not isinstance(item, dict):
            fail(number, "invalid_json_line", "a line must be a JSON object")
            continue
        custom_id = item.get("custom_id")
        if not isinstance(custom_id, str) or not 1 <= len(custom_id) <= MAX_CUSTOM_ID_CHARS:
            fail(
                number,
                "missing_required_parameter",
                f"custom_id must be a string of 1-{MAX_CUSTOM_ID_CHARS} characters",
            )
            continue
        if custom_id in seen:
            fail(number, "duplicate_custom_id", f"custom_id {custom_id!r} is used twice")
            continue
        seen.add(custom_id)
        if item.get("method") != "POST":
            fail(number, "invalid_method", f"method must be POST, got {item.get('method')!r}")
            continue
        if item.get("url") != endpoint:
            fail(
                number,
                "mismatched_endpoint",
                f"url {item.get('url')!r} differs from the batch's endpoint {endpoint!r}",
            )
            continue
        body = item.get("body")
        if not isinstance(body, dict):
            fail(number, "missing_required_parameter", "body must be a JSON object")
            continue
        lines.append(_line(len(lines), custom_id, kind, body))
    if not errors and not lines:
        errors.append({"code": "empty_file", "message": "the file holds no requests", "line": None})
    if len(lines) > MAX_LINES:
        errors.append(
            {
                "code": "too_many_requests",
                "message": f"{len(lines):,} requests, limit {MAX_LINES:,}",
                "line": None,
            }
        )
    if errors:
        raise BatchInputError(errors)
    return lines


def _line(index: int, custom_id: str, kind: Kind, body: dict[str, Any]) -> BatchLine:
    model = ChatCompletionRequest if kind == "chat" else CompletionRequest
    try:
        parsed = model.model_validate(body)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(map(str, e['loc'])) or 'body'}: {e['msg']}" for e in exc.errors()[:5]
        )
        return BatchLine(index, custom_id, kind, None, problems)
    if parsed.stream:
        return BatchLine(index, custom_id, kind, None, "stream is not supported in a batch")
    return BatchLine(index, custom_id, kind, parsed)


def job_id_for(batch_id: str, index: int) -> str:
    """The fleet job of line `index`: the same line always maps to the same id."""
    return f"{batch_id}-{index}"


def batch_id_for_file(data: bytes) -> str:
    """A batch id for the shell runner: the file's content, so a rerun resumes it."""
    return "batch_" + hashlib.sha256(data).hexdigest()[:24]


def to_request(
    batch_id: str,
    line: BatchLine,
    served: ServedModel | None,
    *,
    chat_max_tokens: int = DEFAULT_CHAT_MAX_TOKENS,
    tenant: str = DEFAULT_TENANT,
    priority: Priority = "batch",
) -> GenerationRequest:
    """The fleet job of a valid line: id `job_id_for(batch_id, line.index)`, in band
    `priority` for `tenant`, the served model's sampling defaults where the body leaves
    them unset (raises pydantic's ValidationError where the job's own limits refuse the
    body)."""
    assert line.body is not None
    body = line.body
    asked = body.max_tokens
    if isinstance(body, ChatCompletionRequest):
        asked = body.max_completion_tokens or asked
    if asked is None:
        asked = chat_max_tokens if line.kind == "chat" else DEFAULT_COMPLETION_MAX_TOKENS
    meta: dict[str, Any] = {
        "via": "batch",
        "endpoint": line.kind,
        "batch_id": batch_id,
        "custom_id": line.custom_id[:1024],
    }
    if body.user:
        meta["user"] = body.user
    return job_from_openai(
        body,
        job_id=job_id_for(batch_id, line.index),
        max_tokens=asked,
        sampling_defaults=served.sampling_defaults if served else None,
        metadata=meta,
        priority=priority,
        tenant=tenant,
    )


SUBMIT_REFUSALS = (ValidationError, JobRejected, InvalidRequest)  # the line's own fault


def refused_line(batch_id: str, line: BatchLine, exc: Exception) -> dict[str, Any]:
    """The error line of a line the fleet refused at submit (one of SUBMIT_REFUSALS)."""
    code = exc.reason if isinstance(exc, JobRejected) else "invalid_request"
    return error_line(batch_id, line, code, str(exc)[:2000])


def succeeded(entry: dict[str, Any]) -> bool:
    """Whether an output line is a success (else it belongs in the error file)."""
    response = entry.get("response") or {}
    return entry.get("error") is None and response.get("status_code") == 200


def request_id(batch_id: str, index: int) -> str:
    return f"batch_req_{hashlib.sha256(f'{batch_id}/{index}'.encode()).hexdigest()[:24]}"


def result_line(
    batch_id: str,
    line: BatchLine,
    result: JobResult,
    stopped: BatchStop | None = None,
    served: ServedModel | None = None,
) -> tuple[dict[str, Any], bool]:
    """The output line of a finished job (and True), or its error line (and False).
    `stopped`: the batch is being cancelled or expired, so a cancelled job is one its
    stop cut short (else someone cancelled the job itself). `served`: the model's live
    workers, which say how it writes tool calls."""
    rid = request_id(batch_id, line.index)
    if result.finish_reason in (FinishReason.REJECTED, FinishReason.ERROR):
        api = from_finish(_finish_event(result), retry_after_s=1)
        return {
            "id": rid,
            "custom_id": line.custom_id,
            "response": {
                "status_code": api.status,
                "request_id": result.job_id,
                "body": {"error": api.detail.model_dump(mode="json")},
            },
            "error": None,
        }, False
    if result.finish_reason not in SUCCESS:
        return _unfinished_line(batch_id, line, result, stopped), False
    assert line.body is not None
    out = Renderer(
        line.kind,
        result.job_id,
        line.body.model,
        int(time.time()),
        **reads_calls(line.body, served),
        **echoes(line.body, line.body.prompt_fields().get("prompt")),
    )
    finish = _finish_event(result)
    body = out.body(result.text, finish, result.logprobs, result.prompt).model_dump(mode="json")
    return {
        "id": rid,
        "custom_id": line.custom_id,
        "response": {"status_code": 200, "request_id": result.job_id, "body": body},
        "error": None,
    }, True


def _finish_event(result: JobResult) -> FinishEvent:
    return FinishEvent(
        job_id=result.job_id,
        reason=result.finish_reason,
        usage=result.usage,
        timings=result.timings,
        error=result.error,
        worker=result.worker,
    )


def _unfinished_line(
    batch_id: str, line: BatchLine, result: JobResult, stopped: BatchStop | None
) -> dict[str, Any]:
    """The error line of a job that ended before its model did: cancelled or past its
    deadline. Its partial text is dropped (OpenAI's way); the message says how much."""
    generated = (
        f"its job {result.job_id} was stopped after {result.usage.completion_tokens} "
        "generated token(s), discarded"
    )
    if result.finish_reason == FinishReason.DEADLINE:
        return error_line(batch_id, line, "request_timeout", f"deadline passed: {generated}")
    assert result.finish_reason == FinishReason.CANCELLED, result.finish_reason
    if stopped is None:
        return error_line(
            batch_id, line, "request_cancelled", f"the job was cancelled in the fleet: {generated}"
        )
    return error_line(
        batch_id, line, stopped.value, f"{stopped.cause} before this request finished: {generated}"
    )


def unrun_line(batch_id: str, line: BatchLine, stopped: BatchStop) -> dict[str, Any]:
    """The error line of a line a cancelled or expired batch never submitted."""
    return error_line(
        batch_id, line, stopped.value, f"{stopped.cause} before this request was submitted"
    )


def error_line(batch_id: str, line: BatchLine, code: str, message: str) -> dict[str, Any]:
    """A request with no response: it never became a job (an invalid body, a batch
    stopped before it ran) or its job did not finish (`_unfinished_line`)."""
    return {
        "id": request_id(batch_id, line.index),
        "custom_id": line.custom_id,
        "response": None,
        "error": {"code": code, "message": message},
    }


__all__ = [
    "ENDPOINTS",
    "BatchInputError",
    "BatchLine",
    "BatchStop",
    "batch_id_for_file",
    "error_line",
    "job_id_for",
    "parse_input",
    "refused_line",
    "result_line",
    "succeeded",
    "to_request",
    "unrun_line",
]
