"""The subset of the OpenAI HTTP API the gateway speaks, as pydantic models.

Requests are validated strictly (``extra="forbid"``: an unknown field is a 400
naming it; the fields that cannot change the output are declared and ignored, as
`tokenfleet.openai.fields` lists them) with the fleet's own limits from
`tokenfleet.protocol`, so an error names the OpenAI field (``max_tokens``), not the
protocol one (``max_new_tokens``). Parameters the fleet cannot honour (``echo``) are
refused rather than ignored; ``n`` > 1 and several prompts are one job per choice, which
only the gateway makes (validated in the `FAN_OUT` context: gateway/fanout.py).
Penalties, ``logit_bias`` and logprobs go into the job's ``sampling``
(docs/protocol.md); logprobs are the raw model's.

Extensions beyond OpenAI (the names vLLM uses): ``top_k``, ``repetition_penalty``,
``ignore_eos``, ``stop_token_ids``, ``priority``, ``cache_salt``, and structured output as
``structured_outputs`` or the older ``guided_json`` / ``guided_regex`` /
``guided_choice`` / ``guided_grammar``.

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
from tokenfleet.openai.structured import (
    Choices,
    GrammarText,
    JsonSchemaValue,
    StructuredOutputs,
    choice_regex,
    json_schema,
)
from tokenfleet.protocol import (
    MAX_CACHE_SALT_CHARS,
    MAX_GRAMMAR_CHARS,
    MAX_LOGIT_BIAS,
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
    MAX_TOOL_CALL_ID_CHARS,
    MAX_TOOLS,
    MAX_TOP_LOGPROBS,
    TOOL_NAME_PATTERN,
    FunctionTool,
    GenerationRequest,
    Priority,
    Structured,
)

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
OPENAI_DEFAULT_TEMPERATURE = 1.0  # OpenAI samples unless told otherwise
# Several choices per request (`n`, several completions prompts): each choice is a job.
MAX_N = 16  # choices per prompt
MAX_PROMPTS = 16  # prompts in one /v1/completions request
MAX_CHOICES = 32  # n × prompts: the jobs one request may submit
# The validation context key under which n > 1 and several prompts are accepted: the
# gateway's (`{FAN_OUT: True}`), which fans such a request out into one job per choice.
# Without it (a batch line is one job) they are refused.
FAN_OUT = "fan_out"

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
    """Any other key (OpenAI's `include_obfuscation`, say) is accepted and ignored
    (`tokenfleet.openai.fields`)."""

    model_config = ConfigDict(extra="allow")

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


# The request fields that constrain the output (one at most), as `structured` kinds:
# OpenAI's, vLLM's current `structured_outputs` and its older `guided_*` fields.
_CONSTRAINTS = (
    "response_format",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
)


def _constraint(field: str, value: object) -> dict[str, Any] | None:
    """The job's `structured` field for constraint field `field`'s value (None: none)."""
    if value is None:
        return None
    if isinstance(value, ResponseFormat | StructuredOutputs):
        return value.structured()
    if field == "guided_json":
        assert isinstance(value, dict | str)
        return json_schema(value)
    if field == "guided_choice":
        assert isinstance(value, list)
        return {"kind": "regex", "value": choice_regex(value)}
    assert isinstance(value, str)
    return {"kind": "regex" if field == "guided_regex" else "lark", "value": value}


class _GenerationParams(_Strict):
    """What completions and chat completions share."""

    model: str = Field(min_length=1, max_length=256)
    max_tokens: int | None = Field(default=None, ge=0)  # 0: completions with echo only
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=0, le=MAX_SEED)
    stop: str | list[str] | None = None
    n: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(default=None, max_length=MAX_METADATA_VALUE_CHARS)
    # accepted and ignored: they cannot change the output (tokenfleet.openai.fields.IGNORED)
    metadata: dict[str, str] | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None  # token id (decimal text) -> -100..100
    # extensions
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=100.0)  # vLLM's; 1 = off
    top_k: int | None = Field(default=None, ge=0, le=1_000_000)
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] | None = Field(default=None, max_length=MAX_STOP_TOKEN_IDS)
    # share cached prefix KV only with requests of the same salt (vLLM's field)
    cache_salt: str | None = Field(default=None, min_length=1, max_length=MAX_CACHE_SALT_CHARS)
    response_format: ResponseFormat | None = None
    # extensions, as vLLM names them: `structured_outputs`, and its older fields: the
    # output is a schema's instance / one of the choices / matches a regex / a Lark grammar
    structured_outputs: StructuredOutputs | None = None
    guided_json: JsonSchemaValue | None = None
    guided_regex: GrammarText | None = None
    guided_choice: Choices | None = None
    guided_grammar: GrammarText | None = None
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

    @field_validator(*_CONSTRAINTS)
    @classmethod
    def _usable_grammar(cls, value: object, info: ValidationInfo) -> object:
        """A constraint the fleet could never honour is refused here, before any token:
        one that does not compile, nests too deep, or allows no finite output
        (`worker.grammar.check`, the same check the worker makes)."""
        assert info.field_name is not None
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
        given = {
            name: spec
            for name in _CONSTRAINTS
            if (spec := _constraint(name, getattr(self, name))) is not None
        }
        if len(given) > 1:
            raise ValueError(
                f"{' and '.join(given)} each constrain the output: give one of "
                f"{', '.join(_CONSTRAINTS[:-1])} and {_CONSTRAINTS[-1]}"
            )
        return next(iter(given.values()), None)

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
    def _one_choice(cls, value: int | None, info: ValidationInfo) -> int | None:
        """1 to MAX_N choices where the caller fans out (the `FAN_OUT` context); only 1
        anywhere else."""
        if value in (None, 1):
            return value
        if not _fans_out(info):
            raise ValueError(f"n={value} is not supported: only n=1 (send several requests)")
        if not 1 <= value <= MAX_N:
            raise ValueError(f"n is {value}: give 1 to MAX_N={MAX_N} choices")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _bias_limits(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        if value and len(value) > MAX_LOGIT_BIAS:
            raise ValueError(
                f"logit_bias has {len(value)} entries, limit MAX_LOGIT_BIAS={MAX_LOGIT_BIAS}"
            )
        for key, bias in (value or {}).items():
            if not (key.isascii() and key.isdigit() and int(key) <= MAX_TOKEN_ID):
                raise ValueError(f"logit_bias key {key!r} is not a token id")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"logit_bias[{key!r}] is {bias}, outside [-100, 100]")
        return value

    def logprobs_asked(self) -> int | None:
        """The job's `sampling.logprobs`: None (none), 0 (the sampled token's), k (top k)."""
        return None

    def _penalties_and_logprobs(self) -> dict[str, Any]:
        """The job's sampling fields for penalties, bias and logprobs: those given only
        (the job's defaults switch them off)."""
        given = {
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": self.repetition_penalty,
            "logit_bias": {k: float(v) for k, v in self.logit_bias.items()}
            if self.logit_bias
            else None,
            "logprobs": self.logprobs_asked(),
            "prompt_logprobs": self.prompt_logprobs_asked(),
        }
        return {k: v for k, v in given.items() if v is not None}

    def prompt_logprobs_asked(self) -> int | None:
        """The job's `prompt_logprobs` (completions' echo); None: it asks none."""
        return None

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
                **self._penalties_and_logprobs(),
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
        cls, value: str | list[str] | list[int] | list[list[int]], info: ValidationInfo
    ) -> str | list[str] | list[int] | list[list[int]]:
        """One prompt (`["text"]` and `[[ids]]` are one); several (up to MAX_PROMPTS, and
        n × prompts up to MAX_CHOICES) only where the caller fans out (`FAN_OUT`)."""
        prompts: Any = value  # one prompt, or a list of them (pydantic checked the types)
        if not (isinstance(value, list) and value and isinstance(value[0], str | list)):
            return _checked_prompt(prompts, "the prompt")
        if len(value) == 1:
            return _checked_prompt(prompts[0], "the prompt")
        if not _fans_out(info):
            raise ValueError(
                f"{len(value)} prompts in one request: only one is supported (send several)"
            )
        if len(value) > MAX_PROMPTS:
            raise ValueError(f"{len(value)} prompts, limit MAX_PROMPTS={MAX_PROMPTS}")
        n = info.data.get("n") or 1
        if n * len(value) > MAX_CHOICES:
            raise ValueError(
                f"n={n} choices for each of {len(value)} prompts are {n * len(value)} choices, "
                f"limit MAX_CHOICES={MAX_CHOICES}"
            )
        checked = [_checked_prompt(p, f"prompt {i}") for i, p in enumerate(prompts)]
        return checked  # type: ignore[return-value]  # list[str] or list[list[int]]

    @field_validator("logprobs")
    @classmethod
    def _logprobs_limit(cls, value: int | None) -> int | None:
        if value is not None and not 0 <= value <= MAX_TOP_LOGPROBS:
            raise ValueError(f"logprobs is {value}: give 0 to MAX_TOP_LOGPROBS={MAX_TOP_LOGPROBS}")
        return value

    @model_validator(mode="after")
    def _no_tokens_only_with_echo(self) -> CompletionRequest:
        if self.max_tokens == 0 and not self.echo:
            raise ValueError(
                "max_tokens 0 generates nothing: it is allowed with echo (the prompt's "
                "logprobs) only"
            )
        return self

    def logprobs_asked(self) -> int | None:
        return self.logprobs

    def prompt_logprobs_asked(self) -> int | None:
        """With echo, the worker reports the prompt back: with its logprobs when the request
        asks for logprobs, and for a token-id prompt in any case (the gateway has no
        tokenizer to write it as text). A text prompt without logprobs is echoed here."""
        if not self.echo:
            return None
        if self.logprobs is not None:
            return self.logprobs
        value: Any = self.prompt
        one = (
            value[0]
            if isinstance(value, list) and value and isinstance(value[0], str | list)
            else value
        )
        return None if isinstance(one, str) else 0

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
        """{"prompt": text} or {"prompt_ids": ids}: one job's prompt (several prompts are
        split into one request each before: gateway/fanout.py)."""
        value: Any = self.prompt
        if isinstance(value, list) and value and isinstance(value[0], str | list):
            assert len(value) == 1, f"{len(value)} prompts: one job takes one"
            value = value[0]
        return {"prompt": value} if isinstance(value, str) else {"prompt_ids": list(value)}


def _fans_out(info: ValidationInfo) -> bool:
    return isinstance(info.context, Mapping) and bool(info.context.get(FAN_OUT))


def _checked_prompt(value: str | list[int], name: str) -> str | list[int]:
    """One prompt within the fleet's limits; `name` is how errors call it."""
    if isinstance(value, str):
        if not value:
            raise ValueError(f"{name} is empty")
        if len(value) > MAX_PROMPT_CHARS:
            raise ValueError(
                f"{name} has {len(value):,} characters, limit MAX_PROMPT_CHARS={MAX_PROMPT_CHARS}"
            )
    elif not value:
        raise ValueError(f"{name} is empty")
    elif len(value) > MAX_PROMPT_TOKENS:
        raise ValueError(
            f"{name} has {len(value):,} token ids, limit MAX_PROMPT_TOKENS={MAX_PROMPT_TOKENS}"
        )
    return value


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionCallIn(_Strict):
    name: Annotated[str, Field(pattern=TOOL_NAME_PATTERN)]
    arguments: str = Field(max_length=MAX_MESSAGE_CHARS)  # JSON text, as OpenAI sends it


class ToolCallIn(_Strict):
    """A call an earlier assistant turn made, as the client sends the history back."""

    id: str = Field(min_length=1, max_length=MAX_TOOL_CALL_ID_CHARS)
    type: Literal["function"] = "function"
    function: FunctionCallIn


class FunctionDef(_Strict):
    name: Annotated[str, Field(pattern=TOOL_NAME_PATTERN)]
    description: str | None = Field(default=None, max_length=MAX_MESSAGE_CHARS)
    parameters: dict[str, Any] | None = None  # the arguments' JSON schema
    strict: bool | None = None  # calls always follow the schema here (a grammar holds them)


class ChatTool(_Strict):
    type: Literal["function"]
    function: FunctionDef


class ToolChoiceFunction(_Strict):
    name: Annotated[str, Field(pattern=TOOL_NAME_PATTERN)]


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: ToolChoiceFunction


class ChatMessageIn(_Strict):
    role: Annotated[str, Field(pattern=r"^[a-z_]{1,32}$")]
    content: str | list[TextPart] | None = None
    name: str | None = Field(default=None, max_length=64)
    tool_calls: list[ToolCallIn] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_call_id: str | None = Field(default=None, max_length=MAX_TOOL_CALL_ID_CHARS)

    def fleet_message(self) -> dict[str, Any]:
        """The job's ChatMessage fields for this turn."""
        out: dict[str, Any] = {"role": self.role, "content": self.text}
        if self.tool_calls:
            out["tool_calls"] = [
                {"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
                for c in self.tool_calls
            ]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None and self.role == "tool":
            out["name"] = self.name
        return out

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
    max_completion_tokens: int | None = Field(default=None, ge=0)
    logprobs: bool | None = None
    top_logprobs: int | None = None  # with logprobs: the k most likely tokens too
    # function calling: the tools' schemas hold the calls (tokenfleet.tools)
    tools: list[ChatTool] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # accepted and ignored (tokenfleet.openai.fields.IGNORED)
    store: bool | None = None
    prediction: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _choice_among_tools(self) -> ChatCompletionRequest:
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice):
            names = [t.function.name for t in self.tools or []]
            if choice.function.name not in names:
                raise ValueError(
                    f"tool_choice names the function {choice.function.name!r}, which is not "
                    f"among the tools ({', '.join(names) or 'none given'})"
                )
        elif choice == "required" and not self.tools:
            raise ValueError("tool_choice 'required' needs tools")
        return self

    @model_validator(mode="after")
    def _some_tokens(self) -> ChatCompletionRequest:
        if self.max_tokens == 0 or self.max_completion_tokens == 0:
            raise ValueError("max_tokens must be at least 1 (0 is for completions with echo)")
        return self

    @field_validator("max_completion_tokens")
    @classmethod
    def _completion_limit(cls, value: int | None) -> int | None:
        if value is not None and value > MAX_NEW_TOKENS:
            raise ValueError(
                f"max_completion_tokens is {value}, over the fleet's limit "
                f"MAX_NEW_TOKENS={MAX_NEW_TOKENS}"
            )
        return value

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_limit(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is None:
            return value
        if not 0 <= value <= MAX_TOP_LOGPROBS:
            raise ValueError(
                f"top_logprobs is {value}: give 0 to MAX_TOP_LOGPROBS={MAX_TOP_LOGPROBS}"
            )
        if value and not info.data.get("logprobs"):  # 0 asks nothing: a client's default
            raise ValueError("top_logprobs needs logprobs: true")
        return value

    def logprobs_asked(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def prompt_fields(self) -> dict[str, Any]:
        fields: dict[str, Any] = {"messages": [m.fleet_message() for m in self.messages]}
        if self.tools:  # `tools: []` is no tools
            fields["tools"] = [t.model_dump() for t in self._function_tools()]
            choice = self.tool_choice or "auto"
            fields["tool_choice"] = (
                {"name": choice.function.name} if isinstance(choice, NamedToolChoice) else choice
            )
            fields["parallel_tool_calls"] = (
                True if self.parallel_tool_calls is None else self.parallel_tool_calls
            )
        return fields

    def _function_tools(self) -> list[FunctionTool]:
        return [
            FunctionTool(
                name=t.function.name,
                description=t.function.description,
                parameters=json.dumps(t.function.parameters or {}),
            )
            for t in self.tools or []
        ]

    def callable_tools(self) -> list[FunctionTool]:
        """The functions the answer may call, which the gateway reads back out of its
        text; none when `tool_choice` is "none"."""
        return [] if self.tool_choice == "none" else self._function_tools()


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


class TopLogprobOut(_Out):
    token: str  # the token's own text
    logprob: float
    bytes: list[int] | None  # the token text's UTF-8 bytes


class ChatTokenLogprob(TopLogprobOut):
    top_logprobs: list[TopLogprobOut]  # the k most likely, best first


class ChatLogprobs(_Out):
    """A chat choice's (or chunk's) `logprobs`: one entry per token."""

    content: list[ChatTokenLogprob] | None
    refusal: list[ChatTokenLogprob] | None = None


class CompletionLogprobs(_Out):
    """A completion choice's `logprobs` (the legacy shape): lists parallel to the tokens;
    `text_offset`: where each token's text starts in the choice's text."""

    tokens: list[str]
    token_logprobs: list[float | None]  # None: an echoed prompt's first token
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(_Out):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
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


class FunctionCallOut(_Out):
    name: str
    arguments: str  # JSON text, valid for the function's parameters


class ToolCallOut(_Out):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class ChatMessageOut(_Out):
    """`content` is None when the answer is only tool calls (as OpenAI's is)."""

    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCallOut] | None = None


class ToolCallDelta(_Out):
    """A streamed call: here each call arrives whole, in one delta (its `index` says
    which; clients concatenate `arguments` across deltas of one index)."""

    index: int
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class ChatChoice(_Out):
    index: int = 0
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
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
    tool_calls: list[ToolCallDelta] | None = None

    @model_serializer(mode="wrap")
    def _present_only(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        out: dict[str, Any] = handler(self)
        return {k: v for k, v in out.items() if v is not None}


class ChatChunkChoice(_Out):
    index: int = 0
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
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
