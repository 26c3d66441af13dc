"""vLLM's structured-output fields as the job's one `structured` field.

`structured_outputs` (an object with exactly one of `json`, `regex`, `choice`, `grammar`,
`json_object`) and the older top-level `guided_json` / `guided_choice` map onto the
kinds `tokenfleet.grammar` compiles: a schema is `json_schema` (given as an object or
as its JSON text), a choice list a `regex` alternation of the escaped strings, so the
whole output is exactly one of them. `tokenfleet.openai.models` checks each with
`grammar.check` and allows one constraint per request.
"""

from __future__ import annotations

import json
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from tokenfleet.protocol import MAX_GRAMMAR_CHARS

GrammarText = Annotated[str, Field(min_length=1, max_length=MAX_GRAMMAR_CHARS)]
# a JSON schema: the object, or its JSON text (vLLM takes both)
JsonSchemaValue = dict[str, Any] | GrammarText
Choices = Annotated[list[str], Field(min_length=1)]


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs`: exactly one of `json` (a schema), `regex`, `choice`
    (the output is exactly one of the strings), `grammar` (Lark) or `json_object: true`."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)

    json_: JsonSchemaValue | None = Field(default=None, alias="json")
    regex: GrammarText | None = None
    choice: Choices | None = None
    grammar: GrammarText | None = None
    json_object: bool | None = None

    @model_validator(mode="after")
    def _exactly_one(self) -> StructuredOutputs:
        given = [
            name
            for name, value in (
                ("json", self.json_),
                ("regex", self.regex),
                ("choice", self.choice),
                ("grammar", self.grammar),
                ("json_object", self.json_object or None),
            )
            if value is not None
        ]
        if len(given) != 1:
            raise ValueError(
                f"give exactly one of json, regex, choice, grammar and json_object "
                f"(given: {', '.join(given) or 'none'})"
            )
        return self

    def structured(self) -> dict[str, Any]:
        if self.json_ is not None:
            return json_schema(self.json_)
        if self.regex is not None:
            return {"kind": "regex", "value": self.regex}
        if self.choice is not None:
            return {"kind": "regex", "value": choice_regex(self.choice)}
        if self.grammar is not None:
            return {"kind": "lark", "value": self.grammar}
        return {"kind": "json_object"}


# What is special in a regex (llguidance's dialect, Rust's `regex` syntax) outside a class.
_REGEX_SPECIAL = frozenset("\\.+*?()|[]{}^$")


def choice_regex(choices: list[str]) -> str:
    """A regex the whole output matches exactly when it is one of `choices`."""
    escaped = ("".join(f"\\{c}" if c in _REGEX_SPECIAL else c for c in s) for s in choices)
    return f"({'|'.join(escaped)})"


def json_schema(schema: dict[str, Any] | str) -> dict[str, Any]:
    """A schema object, or its JSON text (checked to be an object by `grammar.check`)."""
    text = schema if isinstance(schema, str) else json.dumps(schema)
    return {"kind": "json_schema", "value": text}
