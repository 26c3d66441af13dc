"""The subset of the OpenAI HTTP API the gateway speaks, as pydantic models.

Requests are validated strictly (``extra="forbid"``: an unknown field is a 400
naming it) with the fleet's own limits from `tokenfleet.protocol`, so an error
names the OpenAI field (``max_tokens``), not the protocol one
(``max_new_tokens``). Parameters the fleet cannot honour (``n`` > 1, penalties,
logprobs, several prompts) are refused rather than ignored.

Extensions beyond OpenAI (the names vLLM uses): ``top_k``, ``ignore_eos``,
``stop_token_ids``, ``priority``.

Priority: OpenAI's ``service_tier`` ("auto" / "default": the API key's own default
band; "priority": interactive; "flex": batch) or vLLM's integer ``priority`` (lower is
more urgent: < 0 interactive, 0 the key's default, > 0 batch). Both may be given only
when they agree.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    ValidationInfo,
    field_validator,
    model_serializer,
    model_validator,
)

from tokenfleet.grammar import GrammarError, check
from tokenfleet.keys import DEFAULT_MODEL, DEFAULT_TENANT
from tokenfleet.protocol import (
    MAX_CACHE_SALT_CHARS,
    MAX_GRAMMAR_CHARS,
    MAX_MESSAGE_CHARS,
    MAX_MESSAGES,
    MAX_METADATA_VALUE_CHARS,
    MAX_NEW_TOKENS,
    MAX_PROMPT_CHARS,
    MAX_PROMPT_TOKENS,
    MAX_SEED,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    MAX_TOKEN_ID,
    GenerationRequest,
    Priority,
    Structured,
)

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
OPENAI_DEFAULT_TEMPERATURE = 1.0  # OpenAI samples unless told otherwise

TokenId = Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]

ServiceTier = Literal["auto", "default", "priority", "flex"]
# What a request's service_tier / priority asks for; KEY_DEFAULT: the API key's band.
KEY_DEFAULT = "key_default"
_TIER_ASKS: dict[str, str] = {
    "auto": KEY_DEFAULT,
    "default": KEY_DEFAULT,
    "priority": "interactive",
    "flex": "batch",
}
# The band a job ran in, as OpenAI names the tier in a response's `service_tier`.
SERVICE_TIER_OF: dict[str, str] = {"interactive": "priority", "default": "default", "batch": "flex"}


def _priority_asks(priority: int) -> str:
    """vLLM's integer priority (lower is more urgent) as a band, or the key's default."""
    if priority < 0:
        return "interactive"
    return "batch" if priority > 0 else KEY_DEFAULT


# ---- requests -----------------------------------------------------------------------


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)

    name: str = Field(default="response", max_length=64)
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(_Strict):
    """OpenAI's `response_format`: text (no constraint), json_object, json_schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("response_format.json_schema goes with type 'json_schema' only")
        return self

    def structured(self) -> dict[str, Any] | None:
        """The job's `structured` field for this format; None for plain text."""
        if self.type == "json_object":
            return {"kind": "json_object"}
        if self.json_schema is not None:
            return {"kind": "json_schema", "value": json.dumps(self.json_schema.schema_)}
        return None


# The request fields that constrain the output (one at most), as `structured` kinds.
_CONSTRAINTS = ("response_format", "guided_regex", "guided_grammar")


def _constraint(field: str | None, value: object) -> dict[str, Any] | None:
    """The job's `structured` field for one constraint field's value (None: no constraint)."""
    if isinstance(value, ResponseFormat):
        return value.structured()
    if isinstance(value, str):
        return {"kind": "regex" if field == "guided_regex" else "lark", "value": value}
    return None


class _GenerationParams(_Strict):
    """What completions and chat completions share."""

    model: str = Field(min_length=1, max_length=256)
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=0, le=MAX_SEED)
    stop: str | list[str] | None = None
    n: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(default=None, max_length=MAX_METADATA_VALUE_CHARS)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    # extensions
    top_k: int | None = Field(default=None, ge=0, le=1_000_000)
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] | None = Field(default=None, max_length=MAX_STOP_TOKEN_IDS)
    # share cached prefix KV only with requests of the same salt (vLLM's field)
    cache_salt: str | None = Field(default=None, min_length=1, max_length=MAX_CACHE_SALT_CHARS)
    response_format: ResponseFormat | None = None
    # extensions, as vLLM names them: the whole output matches a regex / a Lark grammar
    guided_regex: str | None = Field(default=None, min_length=1, max_length=MAX_GRAMMAR_CHARS)
    guided_grammar: str | None = Field(default=None, min_length=1, max_length=MAX_GRAMMAR_CHARS)
    # which band the job waits in (module docstring); `service_tier` before `priority`,
    # whose check reads it
    service_tier: ServiceTier | None = None
    priority: int | None = None  # extension, as vLLM's: lower is more urgent

    @field_validator("priority")
    @classmethod
    def _agrees_with_tier(cls, value: int | None, info: ValidationInfo) -> int | None:
        tier = info.data.get("service_tier")
        if value is not None and tier is not None and _TIER_ASKS[tier] != _priority_asks(value):
            raise ValueError(
                f"priority={value} and service_tier={tier!r} ask for different priorities: "
                "give one of them"
            )
        return value

    def band(self, key_default: Priority) -> Priority:
        """The band the job waits in: what `service_tier` or `priority` asks for, the API
        key's `key_default` where they ask for the default or are not given."""
        asked = KEY_DEFAULT
        if self.service_tier is not None:
            asked = _TIER_ASKS[self.service_tier]
        elif self.priority is not None:
            asked = _priority_asks(self.priority)
        if asked == "interactive":
            return "interactive"
        return "batch" if asked == "batch" else key_default

    @field_validator("response_format", "guided_regex", "guided_grammar")
    @classmethod
    def _usable_grammar(
        cls, value: ResponseFormat | str | None, info: ValidationInfo
    ) -> ResponseFormat | str | None:
        """A constraint the fleet could never honour is refused here, before any token:
        one that does not compile, nests too deep, or allows no finite output
        (`worker.grammar.check`, the same check the worker makes)."""
        spec = _constraint(info.field_name, value)
        if spec is None:
            return value
        size = len(spec.get("value") or "")
        if size > MAX_GRAMMAR_CHARS:
            raise ValueError(
                f"the schema is {size:,} characters as JSON, "
                f"limit MAX_GRAMMAR_CHARS={MAX_GRAMMAR_CHARS}"
            )
        try:
            check(Structured.model_validate(spec))
        except GrammarError as exc:
            raise ValueError(str(exc)) from None
        return value

    @model_validator(mode="after")
    def _one_constraint(self) -> _GenerationParams:
        self.structured()  # raises when more than one is given
        return self

    def structured(self) -> dict[str, Any] | None:
        """The job's `structured` field; at most one constraint may be given."""
        given = [
            spec
            for name in _CONSTRAINTS
            if (spec := _constraint(name, getattr(self, name))) is not None
        ]
        if len(given) > 1:
            raise ValueError("give one of response_format, guided_regex and guided_grammar")
        return given[0] if given else None

    @field_validator("max_tokens")
    @classmethod
    def _max_tokens_limit(cls, value: int | None) -> int | None:
        if value is not None and value > MAX_NEW_TOKENS:
            raise ValueError(
                f"max_tokens is {value}, over the fleet's limit MAX_NEW_TOKENS={MAX_NEW_TOKENS}"
            )
        return value

    @field_validator("n")
    @classmethod
    def _one_choice(cls, value: int | None) -> int | None:
        if value not in (None, 1):
            raise ValueError(f"n={value} is not supported: only n=1 (send several requests)")
        return value

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalty(cls, value: float | None) -> float | None:
        if value not in (None, 0.0):
            raise ValueError("penalties are not supported (only 0)")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _no_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        if value:
            raise ValueError("logit_bias is not supported")
        return value

    @field_validator("stop")
    @classmethod
    def _stop_limits(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else (value or [])
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(
                f"{len(stops)} stop strings, limit MAX_STOP_STRINGS={MAX_STOP_STRINGS}"
            )
        for s in stops:
            if not 1 <= len(s) <= MAX_STOP_STRING_CHARS:
                raise ValueError(
                    f"a stop string has {len(s)} characters; each needs 1 to "
                    f"MAX_STOP_STRING_CHARS={MAX_STOP_STRING_CHARS}"
                )
        return value

    @property
    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def fleet_fields(
        self, max_tokens: int, model_defaults: Mapping[str, Any] | None = None
    ) -> dict[str, Any]:
        """GenerationRequest fields for everything but the prompt, model and job id.

        What the request leaves unset is the model's own default (`model_defaults`,
        from its generation_config.json, as the workers advertise it), and OpenAI's
        (temperature 1, no top-k / top-p filter) when the model names none."""
        defaults = model_defaults or {}
        temperature = self.temperature
        if temperature is None:
            temperature = defaults.get("temperature", OPENAI_DEFAULT_TEMPERATURE)
        return {
            "max_new_tokens": max_tokens,
            "sampling": {
                "temperature": temperature,
                "top_k": self.top_k if self.top_k is not None else defaults.get("top_k", 0),
                "top_p": self.top_p if self.top_p is not None else defaults.get("top_p", 1.0),
                "seed": self.seed,
            },
            "stop": self.stop_list,
            "stop_token_ids": list(self.stop_token_ids or []),
            "ignore_eos": self.ignore_eos,
            "cache_salt": self.cache_salt,
            "structured": self.structured(),
        }


class CompletionRequest(_GenerationParams):
    """POST /v1/completions. `prompt`: one string or one list of token ids."""

    prompt: str | list[str] | list[TokenId] | list[list[TokenId]]
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(
        cls, value: str | list[str] | list[int] | list[list[int]]
    ) -> str | list[str] | list[int] | list[list[int]]:
        if isinstance(value, list) and value and isinstance(value[0], str | list):
            if len(value) != 1:
                raise ValueError(
                    f"{len(value)} prompts in one request: only one is supported (send several)"
                )
            value = value[0]
        if isinstance(value, str):
            if not value:
                raise ValueError("the prompt is empty")
            if len(value) > MAX_PROMPT_CHARS:
                raise ValueError(
                    f"the prompt has {len(value):,} characters, "
                    f"limit MAX_PROMPT_CHARS={MAX_PROMPT_CHARS}"
                )
        elif not value:
            raise ValueError("the prompt is empty")
        elif len(value) > MAX_PROMPT_TOKENS:
            raise ValueError(
                f"the prompt has {len(value):,} token ids, "
                f"limit MAX_PROMPT_TOKENS={MAX_PROMPT_TOKENS}"
            )
        return value

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, value: int | None) -> int | None:
        if value:
            raise ValueError("logprobs are not supported")
        return value

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, value: bool) -> bool:
        if value:
            raise ValueError("echo is not supported")
        return value

    @field_validator("best_of")
    @classmethod
    def _no_best_of(cls, value: int | None) -> int | None:
        if value not in (None, 1):
            raise ValueError("best_of is not supported (only 1)")
        return value

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value: str | None) -> str | None:
        if value:
            raise ValueError("suffix is not supported")
        return value

    def prompt_fields(self) -> dict[str, Any]:
        """{"prompt": text} or {"prompt_ids": ids} (validation left exactly one prompt)."""
        value: Any = self.prompt
        if isinstance(value, list) and value and isinstance(value[0], str | list):
            value = value[0]
        return {"prompt": value} if isinstance(value, str) else {"prompt_ids": list(value)}


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessageIn(_Strict):
    role: Annotated[str, Field(pattern=r"^[a-z_]{1,32}$")]
    content: str | list[TextPart] | None = None
    name: str | None = Field(default=None, max_length=64)  # accepted, not forwarded

    @property
    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""

    @field_validator("content")
    @classmethod
    def _content_limit(cls, value: str | list[TextPart] | None) -> str | list[TextPart] | None:
        size = len(value) if isinstance(value, str) else sum(len(p.text) for p in value or [])
        if size > MAX_MESSAGE_CHARS:
            raise ValueError(
                f"the message has {size:,} characters, limit MAX_MESSAGE_CHARS={MAX_MESSAGE_CHARS}"
            )
        return value


class ChatCompletionRequest(_GenerationParams):
    """POST /v1/chat/completions. The worker renders `messages` with its chat template."""

    messages: list[ChatMessageIn] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None

    @field_validator("max_completion_tokens")
    @classmethod
    def _completion_limit(cls, value: int | None) -> int | None:
        if value is not None and value > MAX_NEW_TOKENS:
            raise ValueError(
                f"max_completion_tokens is {value}, over the fleet's limit "
                f"MAX_NEW_TOKENS={MAX_NEW_TOKENS}"
            )
        return value

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, value: bool | None) -> bool | None:
        if value:
            raise ValueError("logprobs are not supported")
        return value

    def prompt_fields(self) -> dict[str, Any]:
        return {"messages": [{"role": m.role, "content": m.text} for m in self.messages]}


def job_from_openai(
    parsed: CompletionRequest | ChatCompletionRequest,
    *,
    job_id: str,
    max_tokens: int,
    sampling_defaults: Mapping[str, Any] | None = None,
    metadata: dict[str, Any] | None = None,
    deadline: float | None = None,
    queue_deadline: float | None = None,
    priority: Priority = "default",
    tenant: str = DEFAULT_TENANT,
) -> GenerationRequest:
    """The fleet job for an OpenAI request (the gateway's and a batch line's), in band
    `priority` for `tenant` (the request's own service_tier / priority are the caller's
    to resolve: `parsed.band`). Raises pydantic's ValidationError where the job's own
    limits refuse it."""
    fields = {
        **parsed.prompt_fields(),
        **parsed.fleet_fields(max_tokens, sampling_defaults),
        "job_id": job_id,
        "model": None if parsed.model == DEFAULT_MODEL else parsed.model,
        "deadline": deadline,
        "queue_deadline": queue_deadline,
        "priority": priority,
        "tenant": tenant,
        "metadata": metadata or {},
    }
    return GenerationRequest.model_validate(fields)


# ---- responses ----------------------------------------------------------------------


class _Out(BaseModel):
    model_config = ConfigDict(frozen=True)


class PromptTokensDetails(_Out):
    cached_tokens: int = 0


class UsageOut(_Out):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionChoice(_Out):
    index: int = 0
    text: str
    logprobs: None = None
    finish_reason: str | None
    fleet_finish_reason: str | None = None  # the fleet's own reason (cancelled, deadline, ...)


class CompletionResponse(_Out):
    """Both the JSON body and each streamed chunk (OpenAI uses one object type for both)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageOut | None = None


class ChatMessageOut(_Out):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(_Out):
    index: int = 0
    message: ChatMessageOut
    logprobs: None = None
    finish_reason: str
    fleet_finish_reason: str | None = None


class ChatCompletionResponse(_Out):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageOut
    service_tier: str | None = None  # the band it ran in, as OpenAI names tiers


class ChatDelta(_Out):
    """Only the fields a chunk carries: `{"role": ...}` first, then `{"content": ...}`,
    and `{}` in the closing chunk (as OpenAI sends them)."""

    role: Literal["assistant"] | None = None
    content: str | None = None

    @model_serializer(mode="wrap")
    def _present_only(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        out: dict[str, Any] = handler(self)
        return {k: v for k, v in out.items() if v is not None}


class ChatChunkChoice(_Out):
    index: int = 0
    delta: ChatDelta
    logprobs: None = None
    finish_reason: str | None = None
    fleet_finish_reason: str | None = None


class ChatCompletionChunk(_Out):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageOut | None = None
    service_tier: str | None = None


class ModelCard(_Out):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "tokenfleet"
    workers: int  # live workers serving it
    checkpoints: list[str]
    max_job_tokens: int | None  # the largest prompt + max_tokens one of them can hold


class ModelList(_Out):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(_Out):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(_Out):
    error: ErrorDetail
