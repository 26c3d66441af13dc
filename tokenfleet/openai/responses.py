"""OpenAI's Responses API (`POST /v1/responses`) as pydantic models, and its translation
into the chat pipeline: a `ResponsesRequest` becomes a `ChatCompletionRequest`'s fields
(`chat_fields`), so one job runs exactly as a chat completion would; its end becomes a
`ResponseObject` and, streamed, the Responses events in OpenAI's order (`ResponseEvents`).
No FastAPI here: the routes are gateway/responses_api.py, the store
gateway/response_store.py.

Translation:

* `instructions` → a first `system` message (not carried over by
  `previous_response_id`, as OpenAI's are not);
* `input`: a string is one user message; message items keep their role (`developer` is
  `system`), their content parts (`input_text`, `output_text`) joined; `function_call`
  items become an assistant message's `tool_calls` (consecutive calls, and calls after an
  assistant message, go in one message), `function_call_output` items `tool` messages;
* `max_output_tokens` → `max_completion_tokens`; `text.format` → `response_format`
  (`json_schema` with `name`, `schema`, `strict`; `json_object`; `text`); `tools` /
  `tool_choice` / `parallel_tool_calls` → the chat request's, in its shape;
  `temperature`, `top_p`, `user`, `service_tier` as they are.

Fields the fleet cannot honour are refused (`REFUSED`, a 400 naming the field); the
harmless ones are accepted and ignored (`IGNORED`); docs/http.md, "Responses API", is the
table.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    TypeAdapter,
    field_validator,
)

from tokenfleet.openai.models import ServiceTier
from tokenfleet.protocol import (
    MAX_CACHE_SALT_CHARS,
    MAX_MESSAGE_CHARS,
    MAX_METADATA_VALUE_CHARS,
    MAX_NEW_TOKENS,
    MAX_SEED,
    FinishEvent,
)
from tokenfleet.reasons import FinishReason

RESPONSE_PREFIX = "resp_"
MAX_RESPONSE_METADATA = 16  # OpenAI's limits on `metadata`: 16 pairs,
MAX_RESPONSE_METADATA_KEY = 64  # keys of 64 characters,
MAX_RESPONSE_METADATA_VALUE = 512  # values of 512

# Accepted and not acted on: field → why the output is the same either way.
IGNORED: dict[str, str] = {
    "truncation": "only 'disabled' (the default) is accepted: input is never truncated",
    "include": "only [] or 'reasoning.encrypted_content' (no reasoning items are produced)",
    "reasoning": "only without an effort or summary: the models have no separate reasoning",
    "prompt_cache_key": "a hint for OpenAI's cache routing; the fleet's prefix cache needs none",
    "safety_identifier": "an end-user id for OpenAI's abuse monitoring",
    "stream_options": "include_obfuscation: the gateway adds no padding",
}
# OpenAI's fields the fleet does not implement → why (the 400's message).
REFUSED: dict[str, str] = {
    "background": "background responses are not served: stream, or wait for the answer",
    "conversation": "conversations are not stored: use previous_response_id",
    "prompt": "stored prompt templates are not served: send input and instructions",
    "max_tool_calls": "a cap on tool calls is not implemented",
    "top_logprobs": "logprobs are not computed",
    "context_management": "input is never compacted",
    "prompt_cache_retention": "the fleet's prefix cache has no retention setting",
}


def response_id(job_id: str) -> str:
    """The response's id: its job's, so a running response's job is known from its id."""
    return f"{RESPONSE_PREFIX}{job_id}"


def job_of(resp_id: str) -> str | None:
    """The job id inside a response id; None for an id this gateway never made."""
    if not resp_id.startswith(RESPONSE_PREFIX):
        return None
    job = resp_id.removeprefix(RESPONSE_PREFIX)
    return job if job and (job.isalnum() and job.isascii()) else None


# ---- the request ----------------------------------------------------------------------


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)


class ContentPart(_Strict):
    """A message's text part; `output_text` (with its annotations) is an earlier answer
    sent back as input."""

    type: Literal["input_text", "output_text"]
    text: str = Field(max_length=MAX_MESSAGE_CHARS)
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class MessageItem(_Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[ContentPart]
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None
    phase: Literal["commentary", "final_answer"] | None = None

    @property
    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class FunctionCallItem(_Strict):
    """A call the model made (an earlier answer's `function_call` output item)."""

    type: Literal["function_call"]
    call_id: str = Field(min_length=1, max_length=256)
    name: str = Field(min_length=1, max_length=64)
    arguments: str = Field(max_length=MAX_MESSAGE_CHARS)
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class FunctionCallOutputItem(_Strict):
    """What the client's function returned for `call_id`."""

    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1, max_length=256)
    output: str | list[ContentPart]
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None

    @property
    def text(self) -> str:
        if isinstance(self.output, str):
            return self.output
        return "".join(part.text for part in self.output)


def _item_type(value: Any) -> str:
    """An input item's `type`; a message may leave it out (OpenAI's EasyInputMessage)."""
    if isinstance(value, dict):
        return str(value.get("type", "message"))
    return str(getattr(value, "type", "message"))


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")],
    Discriminator(
        _item_type,
        custom_error_type="invalid_value",
        custom_error_message="an input item is a message, a function_call or a "
        "function_call_output (images, files, reasoning and item references are not served)",
    ),
]
INPUT_ITEMS: TypeAdapter[list[InputItem]] = TypeAdapter(list[InputItem])
# `input`: one string or a list of items; tagged so an error names only the branch given
Input = Annotated[
    Annotated[str, Tag("text")] | Annotated[list[InputItem], Tag("items")],
    Discriminator(lambda value: "text" if isinstance(value, str) else "items"),
]
# The union branches' tags in an error's location (`input.items[0].message.content`).
_BRANCHES = re.compile(
    r"\binput\.(?:items|text)|(?<=\])\.(?:message|function_call_output|function_call)\b"
)


def clean_param(text: str) -> str:
    """An error's field path (or message) without the union branches' tags:
    `input.items[0].message.content` → `input[0].content`."""
    return _BRANCHES.sub(lambda m: "input" if m.group(0).startswith("input") else "", text)


class TextFormat(_Strict):
    """`text.format`: plain text, JSON mode, or a JSON schema the output must match."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(default=None, max_length=64)
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None
    description: str | None = None

    def response_format(self) -> dict[str, Any]:
        """The chat request's `response_format`."""
        if self.type != "json_schema":
            return {"type": self.type}
        if self.schema_ is None:
            raise ValueError("text.format of type json_schema needs a schema")
        spec: dict[str, Any] = {"name": self.name or "response", "schema": self.schema_}
        if self.strict is not None:
            spec["strict"] = self.strict
        return {"type": "json_schema", "json_schema": spec}


class TextConfig(_Strict):
    format: TextFormat | None = None
    verbosity: None = None  # the fleet's models take no verbosity setting


class FunctionToolIn(_Strict):
    """A function tool, as the Responses API writes it (flat: no `function` wrapper)."""

    type: Literal["function"]
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]
    description: str | None = Field(default=None, max_length=MAX_MESSAGE_CHARS)
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    def chat(self) -> dict[str, Any]:
        """The tool in the chat request's shape."""
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        if self.parameters is not None:
            function["parameters"] = self.parameters
        if self.strict is not None:
            function["strict"] = self.strict
        return {"type": "function", "function": function}


class ToolChoiceFunction(_Strict):
    type: Literal["function"]
    name: str = Field(min_length=1, max_length=64)


ToolChoice = Literal["none", "auto", "required"] | ToolChoiceFunction


class ReasoningIn(_Strict):
    """Accepted only when it asks for nothing (the models have no separate reasoning)."""

    effort: Literal["none"] | None = None
    summary: None = None
    generate_summary: None = None


class StreamOptionsIn(_Strict):
    include_obfuscation: bool | None = None


class ResponsesRequest(_Strict):
    """POST /v1/responses (module docstring: how each field reaches the job)."""

    model: str = Field(min_length=1, max_length=256)
    input: Input
    instructions: str | None = Field(default=None, max_length=MAX_MESSAGE_CHARS)
    max_output_tokens: int | None = Field(default=None, ge=1, le=MAX_NEW_TOKENS)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    text: TextConfig | None = None
    tools: list[FunctionToolIn] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = Field(default=None, min_length=1, max_length=256)
    metadata: dict[str, str] | None = None
    user: str | None = Field(default=None, max_length=MAX_METADATA_VALUE_CHARS)
    service_tier: ServiceTier | None = None
    # accepted and ignored (IGNORED)
    truncation: Literal["disabled"] | None = None
    include: list[Literal["reasoning.encrypted_content"]] | None = None
    reasoning: ReasoningIn | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    stream_options: StreamOptionsIn | None = None
    # extensions, as the chat endpoint's
    seed: int | None = Field(default=None, ge=0, le=MAX_SEED)
    top_k: int | None = Field(default=None, ge=0, le=1_000_000)
    ignore_eos: bool = False
    cache_salt: str | None = Field(default=None, min_length=1, max_length=MAX_CACHE_SALT_CHARS)

    @field_validator("input")
    @classmethod
    def _some_input(cls, value: str | list[InputItem]) -> str | list[InputItem]:
        if not value:
            raise ValueError("the input is empty")
        if isinstance(value, str) and len(value) > MAX_MESSAGE_CHARS:
            raise ValueError(
                f"the input has {len(value):,} characters, "
                f"limit MAX_MESSAGE_CHARS={MAX_MESSAGE_CHARS}"
            )
        return value

    @field_validator("metadata")
    @classmethod
    def _metadata_limits(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        if value is None:
            return None
        if len(value) > MAX_RESPONSE_METADATA:
            raise ValueError(f"{len(value)} pairs, limit {MAX_RESPONSE_METADATA}")
        for key, item in value.items():
            if len(key) > MAX_RESPONSE_METADATA_KEY or len(item) > MAX_RESPONSE_METADATA_VALUE:
                raise ValueError(
                    f"metadata[{key!r}]: keys hold at most {MAX_RESPONSE_METADATA_KEY} "
                    f"characters, values {MAX_RESPONSE_METADATA_VALUE}"
                )
        return value

    @property
    def items(self) -> list[InputItem]:
        """The input as items (a string is one user message)."""
        if isinstance(self.input, str):
            return [MessageItem(role="user", content=self.input)]
        return list(self.input)

    @property
    def function_tools(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"


def dump_items(items: list[InputItem]) -> list[dict[str, Any]]:
    """Items as JSON values, as a client would send them (what the store keeps)."""
    return [item.model_dump(mode="json", by_alias=True, exclude_none=True) for item in items]


def chat_messages(instructions: str | None, items: list[InputItem]) -> list[dict[str, Any]]:
    """The chat request's `messages` for a conversation (module docstring)."""
    messages: list[dict[str, Any]] = []
    if instructions:
        messages.append({"role": "system", "content": instructions})
    for item in items:
        if isinstance(item, MessageItem):
            role = "system" if item.role == "developer" else item.role
            messages.append({"role": role, "content": item.text})
        elif isinstance(item, FunctionCallItem):
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
                if last["content"] == "":
                    last["content"] = None
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text})
    return messages


def uses_tools(items: list[InputItem]) -> bool:
    return any(not isinstance(item, MessageItem) for item in items)


def chat_fields(request: ResponsesRequest, history: list[InputItem]) -> dict[str, Any]:
    """The `ChatCompletionRequest` fields that run `request` after the conversation
    `history` (the stored input and output of `previous_response_id`; [] for none)."""
    out: dict[str, Any] = {
        "model": request.model,
        "messages": chat_messages(request.instructions, [*history, *request.items]),
        "stream": request.stream,
    }
    fmt = request.text.format if request.text is not None else None
    if fmt is not None and fmt.type != "text":
        out["response_format"] = fmt.response_format()
    if request.tools:
        out["tools"] = [tool.chat() for tool in request.tools]
    choice = request.tool_choice
    if isinstance(choice, ToolChoiceFunction):
        out["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
    elif choice is not None:
        out["tool_choice"] = choice
    given = {
        "max_completion_tokens": request.max_output_tokens,
        "temperature": request.temperature,
        "top_p": request.top_p,
        "parallel_tool_calls": request.parallel_tool_calls,
        "user": request.user,
        "service_tier": request.service_tier,
        "seed": request.seed,
        "top_k": request.top_k,
        "cache_salt": request.cache_salt,
    }
    out |= {name: value for name, value in given.items() if value is not None}
    if request.ignore_eos:
        out["ignore_eos"] = True
    return out


# Chat request fields → the Responses fields they came from (an error's `param`).
PARAM_OF = {
    "messages": "input",
    "max_completion_tokens": "max_output_tokens",
    "response_format": "text.format",
}


def responses_param(param: str | None) -> str | None:
    """A chat request's field name (`messages[3].content`) as the Responses field."""
    if param is None:
        return None
    head = param.split(".", 1)[0].split("[", 1)[0]
    return PARAM_OF.get(head, param) if head in PARAM_OF else param


# ---- the response ---------------------------------------------------------------------


class _Out(BaseModel):
    model_config = ConfigDict(frozen=True)


class OutputText(_Out):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


ItemStatus = Literal["in_progress", "completed", "incomplete"]


class OutputMessage(_Out):
    type: Literal["message"] = "message"
    id: str
    role: Literal["assistant"] = "assistant"
    status: ItemStatus
    content: list[OutputText]


class OutputFunctionCall(_Out):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str
    status: ItemStatus


OutputItem = OutputMessage | OutputFunctionCall


class InputTokensDetails(_Out):
    cached_tokens: int = 0
    cache_write_tokens: int = 0


class OutputTokensDetails(_Out):
    reasoning_tokens: int = 0


class Usage(_Out):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails = OutputTokensDetails()
    total_tokens: int


class IncompleteDetails(_Out):
    reason: Literal["max_output_tokens"] | None = None


class ResponseError(_Out):
    code: str
    message: str


ResponseStatus = Literal["in_progress", "completed", "incomplete", "cancelled", "failed"]


class ResponseObject(_Out):
    """OpenAI's `Response` (what `openai.types.responses.Response` validates)."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: ResponseStatus
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    usage: Usage | None = None
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    previous_response_id: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] = Field(default_factory=list)
    tool_choice: str | dict[str, Any] = "auto"
    parallel_tool_calls: bool = True
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    metadata: dict[str, str] = Field(default_factory=dict)
    store: bool = True
    background: bool = False
    truncation: Literal["disabled"] = "disabled"
    service_tier: str | None = None
    user: str | None = None
    fleet_finish_reason: str | None = None  # the fleet's own word (stop, length, deadline, ...)

    @property
    def output_text(self) -> str:
        return "".join(
            part.text
            for item in self.output
            if isinstance(item, OutputMessage)
            for part in item.content
        )


def skeleton(
    request: ResponsesRequest, job_id: str, created_at: int, service_tier: str | None
) -> ResponseObject:
    """The response before any output: what `response.created` carries."""
    tool_choice: str | dict[str, Any] = "auto"
    if isinstance(request.tool_choice, ToolChoiceFunction):
        tool_choice = request.tool_choice.model_dump()
    elif request.tool_choice is not None:
        tool_choice = request.tool_choice
    text_format = request.text.format if request.text is not None else None
    fmt = {"type": "text"}
    if text_format is not None:
        fmt = text_format.model_dump(mode="json", by_alias=True, exclude_none=True)
    return ResponseObject(
        id=response_id(job_id),
        created_at=created_at,
        status="in_progress",
        model=request.model,
        instructions=request.instructions,
        previous_response_id=request.previous_response_id,
        max_output_tokens=request.max_output_tokens,
        temperature=request.temperature,
        top_p=request.top_p,
        tools=[t.model_dump(mode="json", exclude_none=True) for t in request.tools or []],
        tool_choice=tool_choice,
        parallel_tool_calls=request.parallel_tool_calls is not False,
        text={"format": fmt},
        metadata=dict(request.metadata or {}),
        store=request.store,
        service_tier=service_tier,
        user=request.user,
    )


def usage_of(finish: FinishEvent) -> Usage:
    u = finish.usage
    return Usage(
        input_tokens=u.prompt_tokens,
        input_tokens_details=InputTokensDetails(cached_tokens=u.cached_tokens),
        output_tokens=u.completion_tokens,
        total_tokens=u.prompt_tokens + u.completion_tokens,
    )


def ending(finish: FinishEvent) -> tuple[ResponseStatus, IncompleteDetails | None]:
    """A job's end as the response's status: `stop` completed; `length` and `deadline`
    (a cut by the token or the time budget) incomplete, `max_output_tokens`; `cancelled`
    cancelled."""
    if finish.reason == FinishReason.STOP:
        return "completed", None
    if finish.reason == FinishReason.CANCELLED:
        return "cancelled", None
    return "incomplete", IncompleteDetails(reason="max_output_tokens")


@dataclass(frozen=True)
class Call:
    """One function call read out of the answer (tokenfleet.tools)."""

    call_id: str
    name: str
    arguments: str


# ---- streamed: the events, in OpenAI's order -------------------------------------------


def _sse(event: dict[str, Any]) -> bytes:
    data = json.dumps(event, ensure_ascii=False, separators=(",", ":"))
    return f"event: {event['type']}\ndata: {data}\n\n".encode()


@dataclass
class ResponseEvents:
    """One streamed response's events, each with the next `sequence_number`: `opening`
    (created, in_progress), `text` (the message item and its part are added before its
    first delta), `ending` (the text's done events, each function call's added / delta /
    done, then completed, incomplete or failed). `response` is the response so far."""

    response: ResponseObject
    job_id: str
    seq: int = 0
    text_so_far: list[str] = field(default_factory=list)
    output: list[OutputItem] = field(default_factory=list)
    _message_open: bool = False

    @property
    def message_id(self) -> str:
        return f"msg_{self.job_id}"

    def _event(self, type: str, **fields: Any) -> bytes:
        event = {"type": type, "sequence_number": self.seq, **fields}
        self.seq += 1
        return _sse(event)

    def _lifecycle(self, type: str, response: ResponseObject) -> bytes:
        return self._event(type, response=response.model_dump(mode="json"))

    def opening(self) -> bytes:
        return self._lifecycle("response.created", self.response) + self._lifecycle(
            "response.in_progress", self.response
        )

    def _message(self, status: ItemStatus) -> OutputMessage:
        return OutputMessage(
            id=self.message_id, status=status, content=[OutputText(text="".join(self.text_so_far))]
        )

    def text(self, delta: str) -> bytes:
        """A piece of the message's text (the message is opened with the first)."""
        head = b"" if self._message_open else self._open_message()
        self.text_so_far.append(delta)
        return head + self._event(
            "response.output_text.delta",
            item_id=self.message_id,
            output_index=0,
            content_index=0,
            delta=delta,
            logprobs=[],
        )

    def _open_message(self) -> bytes:
        self._message_open = True
        empty = OutputMessage(id=self.message_id, status="in_progress", content=[])
        return self._event(
            "response.output_item.added", output_index=0, item=empty.model_dump(mode="json")
        ) + self._event(
            "response.content_part.added",
            item_id=self.message_id,
            output_index=0,
            content_index=0,
            part=OutputText(text="").model_dump(mode="json"),
        )

    def ending(self, finish: FinishEvent, calls: list[Call], *, message: bool) -> bytes:
        """Everything after the last delta. `message`: the answer has a message item (text,
        or no call at all), which is opened now if no delta opened it."""
        status, incomplete = ending(finish)
        item_status: ItemStatus = "completed" if status == "completed" else "incomplete"
        out = b""
        if message or self._message_open:
            if not self._message_open:
                out += self._open_message()
            item = self._message(item_status)
            text = item.content[0]
            out += self._event(
                "response.output_text.done",
                item_id=self.message_id,
                output_index=0,
                content_index=0,
                text=text.text,
                logprobs=[],
            )
            out += self._event(
                "response.content_part.done",
                item_id=self.message_id,
                output_index=0,
                content_index=0,
                part=text.model_dump(mode="json"),
            )
            out += self._event(
                "response.output_item.done", output_index=0, item=item.model_dump(mode="json")
            )
            self.output.append(item)
        for call in calls:
            out += self._call(call, item_status)
        done = self.response.model_copy(
            update={
                "status": status,
                "incomplete_details": incomplete,
                "output": list(self.output),
                "usage": usage_of(finish),
                "fleet_finish_reason": str(finish.reason),
            }
        )
        self.response = done
        kind = "response.completed" if status == "completed" else "response.incomplete"
        return out + self._lifecycle(kind, done)

    def _call(self, call: Call, status: ItemStatus) -> bytes:
        index = len(self.output)
        item = OutputFunctionCall(
            id=f"fc_{self.job_id}_{index}",
            call_id=call.call_id,
            name=call.name,
            arguments="",
            status="in_progress",
        )
        done = item.model_copy(update={"arguments": call.arguments, "status": status})
        self.output.append(done)
        return (
            self._event(
                "response.output_item.added", output_index=index, item=item.model_dump(mode="json")
            )
            + self._event(
                "response.function_call_arguments.delta",
                item_id=item.id,
                output_index=index,
                delta=call.arguments,
            )
            + self._event(
                "response.function_call_arguments.done",
                item_id=item.id,
                output_index=index,
                arguments=call.arguments,
            )
            + self._event(
                "response.output_item.done", output_index=index, item=done.model_dump(mode="json")
            )
        )

    def failed(self, code: str, message: str) -> bytes:
        """`response.failed`, the error in the response (`opening` first if not sent)."""
        head = self.opening() if self.seq == 0 else b""
        self.response = self.response.model_copy(
            update={
                "status": "failed",
                "error": ResponseError(code=code, message=message),
                "output": list(self.output),
            }
        )
        return head + self._lifecycle("response.failed", self.response)


def answered(
    response: ResponseObject,
    job_id: str,
    text: str | None,
    calls: list[Call],
    finish: FinishEvent,
) -> ResponseObject:
    """The finished response, not streamed: the message (`text`; None: the answer is only
    calls) and the calls, as the streamed events would have built it."""
    events = ResponseEvents(response, job_id)
    if text:
        events.text_so_far.append(text)
    events.ending(finish, calls, message=text is not None)
    return events.response


def history_of(stored_input: list[dict[str, Any]], output: list[OutputItem]) -> list[InputItem]:
    """A stored response's conversation as input items: its input, then its output."""
    items = [*stored_input, *(item.model_dump(mode="json") for item in output)]
    return INPUT_ITEMS.validate_python(items)
