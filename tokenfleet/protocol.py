"""Every message on the wire: pydantic models, a msgpack codec and the schema version.

Rules any client in any language can rely on (docs/protocol.md is the
reference for them):

* Every message is a msgpack map with an integer field ``v`` (the schema
  version, currently 1). A job payload may also be a JSON object (text
  starting with ``{``), so a shell with ``redis-cli`` can submit jobs.
* Decoding never raises anything but `ProtocolError`, whose ``reason`` is one
  of `DecodeReason`.
* Limits are hard: a payload over a limit is refused with a message naming it.
"""

from __future__ import annotations

import json
import uuid
from enum import StrEnum
from typing import Annotated, Any, Final, Literal, TypeVar

import msgpack
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    ValidationError,
    field_validator,
    model_serializer,
    model_validator,
)

from tokenfleet.errors import ProtocolError
from tokenfleet.keys import (
    DEFAULT_TENANT,
    JOB_ID_PATTERN,
    TENANT_PATTERN,
    valid_job_id,
)
from tokenfleet.keys import Priority as Priority  # re-exported: a field type of the wire
from tokenfleet.reasons import FinishReason

SCHEMA_VERSION: Final = 1

# Hard limits. Changing one is a protocol change: update docs/protocol.md.
MAX_PAYLOAD_BYTES = 1024 * 1024  # one encoded job: room for every field at its limit
# one replay entry or live message: a job's events of up to MAX_STREAM_INTERVAL ticks,
# coalesced (their encodings back to back), a prompt's echo among them
MAX_EVENTS_PAYLOAD_BYTES = 8 * 1024 * 1024
MAX_STREAM_INTERVAL = 64  # ticks a worker may hold a job's token events back
# prompt tokens x (sampling.prompt_logprobs + 1): what one job's echo may carry
MAX_PROMPT_LOGPROB_ENTRIES = 64 * 1024
MAX_PROMPT_CHARS = 64 * 1024  # prompt text, in characters
MAX_PROMPT_TOKENS = 16 * 1024  # prompt_ids length
MAX_NEW_TOKENS = 8192
MAX_TOKEN_ID = 2**31 - 1
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
MAX_MESSAGES = 256  # chat messages per request
MAX_MESSAGE_CHARS = 64 * 1024
MAX_METADATA_ITEMS = 32
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 1024
MAX_CACHE_SALT_CHARS = 256
MAX_GRAMMAR_CHARS = 64 * 1024  # a structured-output schema, regex or grammar
MAX_SEED = 2**63 - 1
MAX_LOGIT_BIAS = 300  # logit_bias entries per job (OpenAI's limit)
MAX_TOP_LOGPROBS = 20  # most likely tokens reported per position (OpenAI's limit)
MAX_TOOLS = 128  # functions per job, and tool calls per assistant message
MAX_TOOL_CALL_ID_CHARS = 64

TOOL_NAME_PATTERN = r"^[A-Za-z0-9_.-]{1,64}$"  # OpenAI's function names (and '.')

MODEL_NAME_PATTERN = r"^[A-Za-z0-9._-]{1,64}$"


class DecodeReason(StrEnum):
    """Why a payload was refused. Stable strings: clients and dead letters carry them."""

    OVERSIZE = "oversize"
    NOT_MSGPACK = "not_msgpack"
    NOT_A_MAP = "not_a_map"
    MISSING_VERSION = "missing_version"
    UNKNOWN_VERSION = "unknown_version"
    INVALID_FIELD = "invalid_field"


def new_job_id() -> str:
    return uuid.uuid4().hex


JobId = Annotated[str, Field(pattern=JOB_ID_PATTERN)]
TenantName = Annotated[str, Field(pattern=TENANT_PATTERN)]
TokenId = Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]
MetaInt = Annotated[int, Field(ge=-(2**63), le=2**64 - 1)]  # what msgpack can carry
MetaValue = str | MetaInt | float | bool | None


class _Message(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


# SamplingParams fields left out of its encoding at these values (they mean "off")
_SAMPLING_OFF: dict[str, Any] = {
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "repetition_penalty": 1.0,
    "logit_bias": {},
    "logprobs": None,
    "prompt_logprobs": None,
}


class SamplingParams(_Message):
    """temperature 0 is greedy; top_k 0 and top_p 1 switch those filters off. A value
    left unset (None) is the model's own default (its generation_config.json), and
    greedy / no filter when the model names none."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False, strict=True)

    temperature: float | None = Field(default=None, ge=0.0, le=10.0)
    top_k: int | None = Field(default=None, ge=0, le=1_000_000)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=0, le=MAX_SEED)
    # Penalties and bias (their defaults are off), applied to the logits before
    # temperature and filters: docs/protocol.md has the formulas.
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=100.0)
    # token id (decimal text, as OpenAI's) -> bias added to its logit
    logit_bias: dict[str, float] = Field(default_factory=dict, max_length=MAX_LOGIT_BIAS)
    # None: no logprobs; 0: each token's own; k: and the k most likely (TokenEvent.logprobs)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    # None: none; k: each prompt token's logprob (but the first's) and the k most likely
    # there, with the prompt's text (`PromptEcho`: completions' echo)
    prompt_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)

    @field_validator("logit_bias")
    @classmethod
    def _bias_entries(cls, value: dict[str, float]) -> dict[str, float]:
        for key, bias in value.items():
            if not (key.isascii() and key.isdigit() and int(key) <= MAX_TOKEN_ID):
                raise ValueError(f"logit_bias key {key!r} is not a token id")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"logit_bias[{key!r}] is {bias}, outside [-100, 100]")
        return value

    @model_serializer(mode="wrap")
    def _compact(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """The penalties, bias and logprobs only when set: a job using none of them
        encodes as it did before they existed."""
        out: dict[str, Any] = handler(self)
        for name, off in _SAMPLING_OFF.items():
            if name in out and out[name] == off:
                del out[name]
        return out

    def bias_pairs(self) -> tuple[tuple[int, float], ...]:
        """logit_bias as (token id, bias) pairs, by id."""
        return tuple(sorted((int(k), float(b)) for k, b in self.logit_bias.items()))


ToolName = Annotated[str, Field(pattern=TOOL_NAME_PATTERN)]


class ToolCall(_Message):
    """A function call the model made: `arguments` is the JSON text of its arguments
    (OpenAI's shape). `id` pairs it with the `tool` message that answers it."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    id: str = Field(min_length=1, max_length=MAX_TOOL_CALL_ID_CHARS)
    name: ToolName
    arguments: str = Field(max_length=MAX_MESSAGE_CHARS)


class ChatMessage(_Message):
    """One chat turn; the worker renders `messages` with its model's chat template.
    An assistant turn may carry the `tool_calls` it made (its content then often empty);
    a `tool` turn answers the call `tool_call_id`."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    role: Annotated[str, Field(pattern=r"^[a-z_]{1,32}$")]
    content: str = Field(max_length=MAX_MESSAGE_CHARS)
    tool_calls: list[ToolCall] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_call_id: str | None = Field(default=None, max_length=MAX_TOOL_CALL_ID_CHARS)
    name: str | None = Field(default=None, max_length=64)


class FunctionTool(_Message):
    """A function the model may call: `parameters` is its arguments' JSON schema, as JSON
    text (an object schema; `{}` when the function takes any object)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    name: ToolName
    description: str | None = Field(default=None, max_length=MAX_MESSAGE_CHARS)
    parameters: str = Field(default="{}", max_length=MAX_GRAMMAR_CHARS)

    @field_validator("parameters")
    @classmethod
    def _object_schema(cls, value: str) -> str:
        try:
            schema = json.loads(value)
        except ValueError as exc:
            raise ValueError(f"parameters is not JSON: {exc}") from None
        if not isinstance(schema, dict):
            raise ValueError("parameters must be a JSON schema object")
        return value


class NamedTool(_Message):
    """`tool_choice` naming one function: the model must call it."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    name: ToolName


# none: never call (the tools still reach the template); auto: the model decides, and a
# call it opens is held to its schema; required: at least one call, to any tool.
ToolChoice = Literal["none", "auto", "required"] | NamedTool


class Structured(_Message):
    """Output the job must match, enforced while it decodes (llguidance): `json_object`
    (any JSON object), `json_schema` (`value`: the schema as JSON text), `regex`
    (`value`: the pattern the whole output matches) or `lark` (`value`: a grammar)."""

    kind: Literal["json_object", "json_schema", "regex", "lark"]
    value: str | None = Field(default=None, min_length=1, max_length=MAX_GRAMMAR_CHARS)

    @model_validator(mode="after")
    def _value_when_needed(self) -> Structured:
        if (self.value is None) != (self.kind == "json_object"):
            raise ValueError(
                "structured.value is required for json_schema, regex and lark, and must be "
                "absent for json_object"
            )
        return self


class GenerationRequest(_Message):
    """One generation job, as a producer submits it."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False, strict=True)

    v: Literal[1] = SCHEMA_VERSION
    job_id: JobId = Field(default_factory=new_job_id)
    prompt: str | None = Field(default=None, min_length=1, max_length=MAX_PROMPT_CHARS)
    prompt_ids: list[TokenId] | None = Field(
        default=None, min_length=1, max_length=MAX_PROMPT_TOKENS
    )
    messages: list[ChatMessage] | None = Field(default=None, min_length=1, max_length=MAX_MESSAGES)
    # 0: prefill only (the prompt's logprobs, or its KV into the prefix cache)
    max_new_tokens: int = Field(default=128, ge=0, le=MAX_NEW_TOKENS)
    sampling: SamplingParams = Field(default_factory=SamplingParams)
    stop: list[Annotated[str, Field(min_length=1, max_length=MAX_STOP_STRING_CHARS)]] = Field(
        default_factory=list, max_length=MAX_STOP_STRINGS
    )
    stop_token_ids: list[TokenId] = Field(default_factory=list, max_length=MAX_STOP_TOKEN_IDS)
    ignore_eos: bool = False  # keep generating past the model's end-of-sequence tokens
    deadline: float | None = Field(default=None, ge=0.0, description="unix time, seconds")
    # Unix time by which a worker must have started the job: one that is still queued
    # then ends as `deadline` (error reason `queue_deadline`) before any prefill.
    queue_deadline: float | None = Field(default=None, ge=0.0, description="unix time, seconds")
    model: Annotated[str, Field(pattern=MODEL_NAME_PATTERN)] | None = None
    # Jobs share cached prefix KV blocks only with jobs of the same salt (None is a salt
    # too): a tenant that must not learn from cache timing sends a secret of its own.
    cache_salt: str | None = Field(default=None, min_length=1, max_length=MAX_CACHE_SALT_CHARS)
    structured: Structured | None = None  # constrain the output (JSON schema, regex, ...)
    # Functions the model may call (chat jobs): rendered through the chat template, the
    # calls held to their schemas by a grammar (tokenfleet.tools).
    tools: list[FunctionTool] | None = Field(default=None, min_length=1, max_length=MAX_TOOLS)
    tool_choice: ToolChoice = "auto"
    parallel_tool_calls: bool = True  # may one answer call several functions
    # Which band the job waits in: workers fleet-wide pull interactive before default
    # before batch (with a starvation guard), and start it ahead of lower bands locally.
    priority: Priority = "default"  # its band (keys.BANDS): the stream it waits in
    # Whose job it is: the tenant's queued and running limits apply to it (keys.py).
    tenant: TenantName = DEFAULT_TENANT
    metadata: dict[Annotated[str, Field(max_length=MAX_METADATA_KEY_CHARS)], MetaValue] = Field(
        default_factory=dict, max_length=MAX_METADATA_ITEMS
    )

    @field_validator("metadata")
    @classmethod
    def _short_values(cls, value: dict[str, MetaValue]) -> dict[str, MetaValue]:
        for key, item in value.items():
            if isinstance(item, str) and len(item) > MAX_METADATA_VALUE_CHARS:
                raise ValueError(
                    f"metadata[{key!r}] has {len(item)} characters, "
                    f"limit {MAX_METADATA_VALUE_CHARS}"
                )
        return value

    @model_validator(mode="after")
    def _one_prompt(self) -> GenerationRequest:
        given = [x is not None for x in (self.prompt, self.prompt_ids, self.messages)]
        if sum(given) != 1:
            raise ValueError(
                "give exactly one of prompt (text), prompt_ids (token ids) or messages (chat)"
            )
        return self

    @model_validator(mode="after")
    def _tools_usable(self) -> GenerationRequest:
        if self.tools is None:
            if self.tool_choice not in ("none", "auto"):
                raise ValueError("tool_choice asks for a call but no tools are given")
            return self
        if self.messages is None:
            raise ValueError("tools need a chat job (messages)")
        names = [t.name for t in self.tools]
        if len(set(names)) != len(names):
            raise ValueError("two tools have the same name")
        choice = self.tool_choice
        if isinstance(choice, NamedTool) and choice.name not in names:
            raise ValueError(f"tool_choice names {choice.name!r}, which is not among the tools")
        if self.structured is not None and choice == "auto":  # forced: the call is the output
            raise ValueError(
                "a structured output and tools the model may or may not call cannot be "
                "combined: give tool_choice 'none', 'required' or a function, or describe "
                "the output as a tool"
            )
        return self


class Usage(_Message):
    prompt_tokens: int = Field(default=0, ge=0)
    completion_tokens: int = Field(default=0, ge=0)
    # prompt tokens whose KV the worker's prefix cache supplied (not computed again)
    cached_tokens: int = Field(default=0, ge=0)


class Timings(_Message):
    """Seconds; None where the phase never happened (e.g. no first token)."""

    queued_s: float | None = None  # submit → first admitted by a worker
    ttft_s: float | None = None  # submit → first token
    total_s: float | None = None  # submit → terminal event


class ErrorInfo(_Message):
    """Why a job was rejected or failed: a stable reason string and a human message."""

    reason: str = Field(max_length=64)
    message: str = Field(max_length=4096)


TopLogprob = tuple[TokenId, float, str]  # (token id, logprob, the token's own text)


class TokenLogprob(_Message):
    """A sampled token's logprob, its own text (`tokenizer.decode([id])`, which can differ
    from the event's `text` delta) and the `sampling.logprobs` most likely tokens, best
    first: log-softmax of the raw model logits (before penalties, bias, grammar mask,
    temperature and filters)."""

    logprob: float
    token: str = ""
    top: list[TopLogprob] = Field(default_factory=list, max_length=MAX_TOP_LOGPROBS)


class PromptEcho(_Message):
    """The prompt as the model read it, for a job that asked for its logprobs
    (`sampling.prompt_logprobs`): its text (the job's `prompt`, else its ids decoded), its
    first token's own text, and each later token's logprob given the tokens before it
    (the same raw log-softmax as `TokenLogprob`; the first token has none)."""

    text: str = ""
    first_token: str = ""
    logprobs: list[TokenLogprob] = Field(default_factory=list)


class TokenEvent(_Message):
    """One generated token. `index` counts from 0 per job; `text` is a UTF-8-safe delta.
    `logprobs` only when the job asked for them (`sampling.logprobs`); absent on the wire
    otherwise. `prompt`: on index 0 only, when the job asked for its prompt's logprobs."""

    v: Literal[1] = SCHEMA_VERSION
    type: Literal["token"] = "token"
    job_id: JobId
    index: int = Field(ge=0)
    token_id: TokenId
    text: str = ""
    logprobs: TokenLogprob | None = None
    prompt: PromptEcho | None = None

    @model_serializer(mode="wrap")
    def _compact(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return _without_none(handler(self), "logprobs", "prompt")


class FinishEvent(_Message):
    """The last event of every job, exactly one per job."""

    v: Literal[1] = SCHEMA_VERSION
    type: Literal["finish"] = "finish"
    job_id: JobId
    reason: FinishReason
    usage: Usage = Field(default_factory=Usage)
    timings: Timings = Field(default_factory=Timings)
    error: ErrorInfo | None = None
    worker: str | None = None
    # the prompt's logprobs when the job asked for them and emitted no token (else
    # its first token event carries them)
    prompt: PromptEcho | None = None

    @model_serializer(mode="wrap")
    def _compact(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return _without_none(handler(self), "prompt")


Event = Annotated[TokenEvent | FinishEvent, Field(discriminator="type")]


class JobResult(_Message):
    """The stored outcome of a job (kept with a TTL under `keys.result`)."""

    v: Literal[1] = SCHEMA_VERSION
    job_id: JobId
    text: str = ""
    token_ids: list[TokenId] = Field(default_factory=list)
    finish_reason: FinishReason
    usage: Usage = Field(default_factory=Usage)
    timings: Timings = Field(default_factory=Timings)
    error: ErrorInfo | None = None
    worker: str | None = None
    # one per token_ids entry when the job asked for them (sampling.logprobs); absent
    # on the wire otherwise, and for a job another worker resumed (its events in the
    # replay stream carry them all the same).
    logprobs: list[TokenLogprob] | None = None
    prompt: PromptEcho | None = None  # when the job asked for the prompt's logprobs

    @model_serializer(mode="wrap")
    def _compact(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return _without_none(handler(self), "logprobs", "prompt")


def _without_none(out: dict[str, Any], *names: str) -> dict[str, Any]:
    """Optional fields left off the wire when unset: messages without them encode as
    they did before the fields existed."""
    for name in names:
        if name in out and out[name] is None:
            del out[name]
    return out


class _EventEnvelope(BaseModel):
    event: Event


M = TypeVar("M", bound=BaseModel)


def encode(message: BaseModel) -> bytes:
    """msgpack bytes of a message (enums as their string values)."""
    packed: bytes = msgpack.packb(message.model_dump(mode="json"), use_bin_type=True)
    return packed


def _sized(data: bytes, limit: int = MAX_PAYLOAD_BYTES) -> bytes:
    if not isinstance(data, bytes | bytearray | memoryview):
        raise ProtocolError(DecodeReason.NOT_MSGPACK, f"expected bytes, got {type(data).__name__}")
    if len(data) > limit:
        raise ProtocolError(DecodeReason.OVERSIZE, f"payload is {len(data)} bytes, limit {limit}")
    return bytes(data)


def _unpack(data: bytes, *, allow_json: bool) -> dict[str, Any]:
    raw = _sized(data)
    try:
        if allow_json and raw[:1] == b"{":
            obj = json.loads(raw)
        else:
            obj = msgpack.unpackb(raw, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise ProtocolError(
            DecodeReason.NOT_MSGPACK, f"cannot decode payload ({type(exc).__name__}: {exc})"
        ) from None
    return _checked_map(obj)


def _checked_map(obj: Any) -> dict[str, Any]:
    """A decoded payload that is a map of this schema version (ProtocolError if not)."""
    if not isinstance(obj, dict):
        raise ProtocolError(DecodeReason.NOT_A_MAP, f"expected a map, got {type(obj).__name__}")
    readable_id = _readable_id(obj)
    if "v" not in obj:
        raise ProtocolError(DecodeReason.MISSING_VERSION, "field 'v' is missing", readable_id)
    if type(obj["v"]) is not int or obj["v"] != SCHEMA_VERSION:
        raise ProtocolError(
            DecodeReason.UNKNOWN_VERSION,
            f"schema version {obj['v']!r} is not supported (this side speaks {SCHEMA_VERSION})",
            readable_id,
        )
    return obj


def _invalid(exc: ValidationError, obj: dict[str, Any]) -> ProtocolError:
    problems = []
    for err in exc.errors(include_url=False)[:5]:
        where = ".".join(str(p) for p in err["loc"]) or "(message)"
        problems.append(f"{where}: {err['msg']}")
    return ProtocolError(DecodeReason.INVALID_FIELD, "; ".join(problems), _readable_id(obj))


def _readable_id(obj: dict[str, Any]) -> str | None:
    """The map's job id when it is a valid one (so the job's client can be told)."""
    job_id = obj.get("job_id")
    return job_id if isinstance(job_id, str) and valid_job_id(job_id) else None


def _validate(model: type[M], obj: dict[str, Any], message: dict[str, Any] | None = None) -> M:
    """Validate `obj` as `model`; `message` is the decoded map errors report on."""
    try:
        return model.model_validate(obj)
    except ValidationError as exc:
        raise _invalid(exc, obj if message is None else message) from None
    except Exception as exc:  # a validator tripping on a hostile shape is still bad input
        raise ProtocolError(DecodeReason.INVALID_FIELD, str(exc)[:500]) from None


def decode_request(data: bytes) -> GenerationRequest:
    """A job payload (msgpack map, or JSON object text) → `GenerationRequest`."""
    return _validate(GenerationRequest, _unpack(data, allow_json=True))


def decode_event(data: bytes) -> TokenEvent | FinishEvent:
    obj = _unpack(data, allow_json=False)
    return _validate(_EventEnvelope, {"event": obj}, obj).event


def decode_events(data: bytes) -> list[TokenEvent | FinishEvent]:
    """The events of one replay entry or live message: one or more encoded events back
    to back (a worker coalescing several ticks of a job's tokens sends them as one).
    Raises ProtocolError when any part is not a valid event (the whole payload is bad)."""
    raw = _sized(data, MAX_EVENTS_PAYLOAD_BYTES)
    unpacker = msgpack.Unpacker(
        raw=False, strict_map_key=True, max_buffer_size=MAX_EVENTS_PAYLOAD_BYTES
    )
    # A nil after the payload: read back as the last object exactly when every object
    # before it was whole (a truncated one would swallow it).
    unpacker.feed(raw + b"\xc0")
    events: list[TokenEvent | FinishEvent] = []
    try:
        objs = list(unpacker)
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise ProtocolError(
            DecodeReason.NOT_MSGPACK, f"cannot decode payload ({type(exc).__name__}: {exc})"
        ) from None
    if len(objs) < 2 or objs.pop() is not None or unpacker.tell() != len(raw) + 1:
        raise ProtocolError(DecodeReason.NOT_MSGPACK, "empty or truncated payload")
    for obj in objs:
        checked = _checked_map(obj)
        events.append(_validate(_EventEnvelope, {"event": checked}, checked).event)
    return events


def decode_result(data: bytes) -> JobResult:
    return _validate(JobResult, _unpack(data, allow_json=False))
