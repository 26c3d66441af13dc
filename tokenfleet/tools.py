"""Tool calling: how a model's chat template is told about functions, the grammar that
holds its calls to their schemas, and reading the calls back out of its text.

A model family writes its calls in its own format (`ToolFormat`), which its chat
template shows; `tool_format` reads it off the template's source:

* ``hermes``: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, one
  block per call (Qwen2.5 / Qwen3, Hermes, and every model whose template has no tool
  format of its own: SmolLM2, the built-in presets);
* ``llama3_json``: the whole answer is ``{"name": ..., "parameters": {...}}`` (calls
  separated by ``; ``), optionally after ``<|python_tag|>`` (Llama 3.1 / 3.2);
* ``mistral``: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`` (Mistral v0.3).

A template that renders `tools` itself gets them as Hugging Face templates expect
(`tools` in OpenAI's shape, assistant `tool_calls` with `arguments` as an object, `tool`
turns with their `tool_call_id`). One that does not gets the Hermes convention written
into the conversation: the functions in the system turn, calls as ``<tool_call>``
blocks in the assistant's text, results as ``<tool_response>`` blocks in a user turn.

The grammar (`tool_grammar`, a Lark grammar for llguidance) is what makes a returned
call always valid JSON for its function's schema, not a parser's best effort:
`required` and a named `tool_choice` force a call from the first token; `auto` leaves
the model free until it writes the format's opening marker, after which the rest of the
call is held to the schemas (the text before the marker can be anything without it).
The gateway reads the calls back with `split_calls` (whole text) or `CallStream` (as the
tokens arrive); a call cut short (`length`) is no call: the text stays content.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from tokenfleet.protocol import (
    ChatMessage,
    FunctionTool,
    GenerationRequest,
    NamedTool,
    Structured,
    ToolCall,
)


class ToolFormat(StrEnum):
    """How a model family writes its calls (module docstring). Stable strings: workers
    advertise theirs in their hash (`tool_format`)."""

    HERMES = "hermes"
    LLAMA3_JSON = "llama3_json"
    MISTRAL = "mistral"


DEFAULT_FORMAT = ToolFormat.HERMES

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
MISTRAL_OPEN = "[TOOL_CALLS]"
PYTHON_TAG = "<|python_tag|>"


def tool_format(template: str | None) -> ToolFormat:
    """The call format a chat template teaches its model; Hermes when it shows none."""
    source = template or ""
    if MISTRAL_OPEN in source:
        return ToolFormat.MISTRAL
    if HERMES_OPEN in source:
        return ToolFormat.HERMES
    if PYTHON_TAG in source or "ipython" in source:
        return ToolFormat.LLAMA3_JSON
    return DEFAULT_FORMAT


def renders_tools(template: str | None) -> bool:
    """Whether the template writes `tools` into the prompt itself."""
    return template is not None and re.search(r"\btools\b", template) is not None


# ---- into the prompt ------------------------------------------------------------------


def _schema(tool: FunctionTool) -> dict[str, Any]:
    parameters = json.loads(tool.parameters)
    return parameters if parameters else {"type": "object"}


def openai_tools(tools: Sequence[FunctionTool]) -> list[dict[str, Any]]:
    """`tools` as chat templates read them (OpenAI's request shape)."""
    out = []
    for t in tools:
        function: dict[str, Any] = {"name": t.name, "parameters": _schema(t)}
        if t.description:
            function["description"] = t.description
        out.append({"type": "function", "function": function})
    return out


def _arguments(call: ToolCall) -> Any:
    """A call's arguments as an object where they parse (templates `tojson` them)."""
    try:
        return json.loads(call.arguments)
    except ValueError:
        return call.arguments


def _hermes_block(call: ToolCall) -> str:
    body = json.dumps({"name": call.name, "arguments": _arguments(call)}, ensure_ascii=False)
    return f"{HERMES_OPEN}\n{body}\n{HERMES_CLOSE}"


def hermes_system_prompt(tools: Sequence[FunctionTool]) -> str:
    """The functions, and how to call them, for a model whose template says nothing."""
    listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in openai_tools(tools))
    return (
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n"
        f"<tools>\n{listed}\n</tools>\n\n"
        "For each function call, return a json object with function name and arguments "
        f"within {HERMES_OPEN}{HERMES_CLOSE} XML tags:\n"
        f'{HERMES_OPEN}\n{{"name": <function-name>, "arguments": <args-json-object>}}\n'
        f"{HERMES_CLOSE}"
    )


@dataclass(frozen=True)
class ChatInput:
    """What `render_chat` gets: the turns, and `tools` for a template that renders them."""

    turns: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None


def chat_input(request: GenerationRequest, template: str | None) -> ChatInput:
    """The job's messages (and tools) as its model's template should see them."""
    messages = request.messages or []
    if renders_tools(template):
        turns = [_native_turn(m) for m in messages]
        return ChatInput(turns, openai_tools(request.tools) if request.tools else None)
    turns = [_hermes_turn(m) for m in messages]
    if request.tools:
        prompt = hermes_system_prompt(request.tools)
        if turns and turns[0]["role"] == "system":
            turns[0] = {"role": "system", "content": f"{turns[0]['content']}\n\n{prompt}"}
        else:
            turns.insert(0, {"role": "system", "content": prompt})
    return ChatInput(_merge_tool_responses(turns))


def _native_turn(m: ChatMessage) -> dict[str, Any]:
    turn: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.tool_calls:
        turn["tool_calls"] = [
            {
                "id": c.id,
                "type": "function",
                "function": {"name": c.name, "arguments": _arguments(c)},
            }
            for c in m.tool_calls
        ]
    if m.tool_call_id is not None:
        turn["tool_call_id"] = m.tool_call_id
    if m.name is not None:
        turn["name"] = m.name
    return turn


def _hermes_turn(m: ChatMessage) -> dict[str, Any]:
    if m.role == "tool":
        return {"role": "user", "content": f"<tool_response>\n{m.content}\n</tool_response>"}
    content = m.content
    if m.tool_calls:
        blocks = "\n".join(_hermes_block(c) for c in m.tool_calls)
        content = f"{content}\n{blocks}" if content else blocks
    return {"role": m.role, "content": content}


def _merge_tool_responses(turns: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Consecutive tool results in one user turn (as Qwen's template writes them)."""
    out: list[dict[str, Any]] = []
    for turn in turns:
        previous = out[-1] if out else None
        if (
            previous is not None
            and previous["role"] == turn["role"] == "user"
            and previous["content"].startswith("<tool_response>")
            and turn["content"].startswith("<tool_response>")
        ):
            out[-1] = {"role": "user", "content": f"{previous['content']}\n{turn['content']}"}
        else:
            out.append(turn)
    return out


# ---- the grammar ------------------------------------------------------------------------


def _call_schema(tool: FunctionTool, fmt: ToolFormat) -> dict[str, Any]:
    key = "parameters" if fmt is ToolFormat.LLAMA3_JSON else "arguments"
    return {
        "type": "object",
        "properties": {"name": {"const": tool.name}, key: _schema(tool)},
        "required": ["name", key],
        "additionalProperties": False,
    }


def _lark_string(text: str) -> str:
    return json.dumps(text)


def _not_containing(marker: str) -> str:
    """A Lark token body: any text in which `marker` does not occur."""
    escaped = re.escape(marker).replace("/", "\\/")
    return f"/(.|\\n)*/ & ~/(.|\\n)*{escaped}(.|\\n)*/"


# JSON as `json.dumps` writes it (and as the formats' own examples show it): one space
# after ',' and ':', none elsewhere
GUIDANCE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def tool_grammar(request: GenerationRequest, fmt: ToolFormat) -> Structured | None:
    """The grammar a job with tools decodes under; None where nothing is constrained
    (no tools, or `tool_choice` none)."""
    tools, choice = request.tools, request.tool_choice
    if not tools or choice == "none":
        return None
    if isinstance(choice, NamedTool):
        tools = [t for t in tools if t.name == choice.name]
    schemas = [_call_schema(t, fmt) for t in tools]
    body = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    # no free whitespace to wander in (a random or small model fills it for ever)
    body = {**body, "x-guidance": GUIDANCE}
    forced = choice != "auto"
    several = request.parallel_tool_calls and not isinstance(choice, NamedTool)
    lines = [f"call_body: %json {json.dumps(body, ensure_ascii=False)}"]
    if fmt is ToolFormat.HERMES:
        lines += [
            f"OPEN: {_lark_string(HERMES_OPEN + chr(10))}",
            f"CLOSE: {_lark_string(chr(10) + HERMES_CLOSE)}",
            "call: OPEN call_body CLOSE",
            f"SEP: {_lark_string(chr(10))}",
        ]
        more = " (SEP call)*" if several else ""
        if forced:
            start = f"start: call{more}"
        else:  # free text, or text and then the calls; the text and the marker are one
            # token, so the lexer never has to cut a text token short at the marker
            lines += [f"TEXT: {_not_containing(HERMES_OPEN)}", "LEAD: TEXT OPEN"]
            start = f"start: TEXT | LEAD call_body CLOSE{more}"
    elif fmt is ToolFormat.MISTRAL:
        lines += [f"OPEN: {_lark_string(MISTRAL_OPEN + '[')}"]
        rest = ' (", " call_body)* "]"' if several else ' "]"'
        if forced:
            start = f"start: OPEN call_body{rest}"
        else:
            lines += [f"TEXT: {_not_containing(MISTRAL_OPEN)}", "LEAD: TEXT OPEN"]
            start = f"start: TEXT | LEAD call_body{rest}"
    else:  # llama3_json: the whole answer is the calls, or it is text
        calls = 'TAG? call_body ("; " call_body)*' if several else "TAG? call_body"
        lines += [f"TAG: {_lark_string(PYTHON_TAG)}"]
        if forced:
            start = f"start: {calls}"
        else:
            lines += ["TEXT: /(.|\\n)*/ & ~/\\s*(\\{|<\\|python_tag\\|>)(.|\\n)*/"]
            start = f"start: TEXT | {calls}"
    return Structured(kind="lark", value="\n".join([start, *lines]) + "\n")


# ---- out of the text --------------------------------------------------------------------


def call_id(job_id: str, index: int) -> str:
    """The id of a job's `index`-th call: the same on every read of the same job (the
    streamed and the stored answer, a replay, a resumed job)."""
    digest = hashlib.sha256(f"{job_id}:{index}".encode()).hexdigest()[:24]
    return f"call_{digest}"


@dataclass(frozen=True)
class Split:
    """A finished answer: its text before the calls (None when there is none) and its
    calls. No calls: `content` is the whole text."""

    content: str | None
    calls: list[ToolCall]


def _objects(text: str, separator: str) -> list[Any] | None:
    """The JSON values `text` is made of, `separator` between them; None if not that."""
    decoder = json.JSONDecoder()
    values, i = [], 0
    while True:
        while i < len(text) and text[i].isspace():
            i += 1
        try:
            value, i = decoder.raw_decode(text, i)
        except ValueError:
            return None
        values.append(value)
        rest = text[i:].lstrip()
        if not rest:
            return values
        if not rest.startswith(separator):
            return None
        i = len(text) - len(rest) + len(separator)


def _as_call(value: Any, key: str, names: frozenset[str]) -> tuple[str, str] | None:
    if not isinstance(value, dict) or set(value) != {"name", key}:
        return None
    name, arguments = value["name"], value[key]
    if not isinstance(name, str) or name not in names or not isinstance(arguments, dict):
        return None
    return name, json.dumps(arguments, ensure_ascii=False)


def _calls_of(fmt: ToolFormat, text: str) -> tuple[int, list[Any]] | None:
    """Where the calls begin in `text`, and the JSON values they are; None: no calls."""
    if fmt is ToolFormat.HERMES:
        start = text.find(HERMES_OPEN)
        if start < 0:
            return None
        values: list[Any] = []
        rest = text[start:]
        while rest:  # closed blocks, whitespace between them, nothing after the last
            if not rest.startswith(HERMES_OPEN):
                return None
            body, closed, rest = rest[len(HERMES_OPEN) :].partition(HERMES_CLOSE)
            if not closed and values:  # the answer's end cut its last call: the whole
                break  # ones before it stand (a model chaining calls up to max_tokens)
            parsed = _objects(body, ",")
            if not closed or parsed is None or len(parsed) != 1:
                return None
            values.append(parsed[0])
            rest = rest.lstrip()
        return start, values
    if fmt is ToolFormat.MISTRAL:
        start = text.find(MISTRAL_OPEN)
        if start < 0:
            return None
        parsed = _objects(text[start + len(MISTRAL_OPEN) :], ",")
        if parsed is None or len(parsed) != 1 or not isinstance(parsed[0], list):
            return None
        return start, list(parsed[0])
    stripped = text.lstrip()
    start = len(text) - len(stripped)
    if stripped.startswith(PYTHON_TAG):
        stripped = stripped[len(PYTHON_TAG) :]
    if not stripped.lstrip().startswith("{"):
        return None
    parsed = _objects(stripped, ";")
    return None if parsed is None else (start, parsed)


def split_calls(fmt: ToolFormat, text: str, tools: Sequence[FunctionTool], job_id: str) -> Split:
    """The calls in a finished answer. Anything that is not wholly a well-formed call to
    one of `tools` (an unknown name, a first call cut short) leaves the whole text
    content; a Hermes call cut short after whole ones is dropped, the whole ones kept."""
    found = _calls_of(fmt, text)
    key = "parameters" if fmt is ToolFormat.LLAMA3_JSON else "arguments"
    if found is None or not found[1]:
        return Split(text, [])
    start, values = found
    names = frozenset(t.name for t in tools)
    calls = []
    for i, value in enumerate(values):
        call = _as_call(value, key, names)
        if call is None:
            return Split(text, [])
        calls.append(ToolCall(id=call_id(job_id, i), name=call[0], arguments=call[1]))
    content = text[:start]
    return Split(content if content.strip() else None, calls)


@dataclass
class CallStream:
    """Reads calls out of an answer as its tokens arrive: `feed` returns the content that
    can be shown now, holding back whatever may turn out to be a call; `finish` splits
    what was held (`split_calls` on the whole text, so the streamed answer equals the
    stored one)."""

    fmt: ToolFormat
    tools: Sequence[FunctionTool]
    job_id: str
    text: str = ""
    shown: int = 0  # characters of `text` already returned as content
    held: bool = field(default=False)  # a call may have begun: show nothing more

    def feed(self, delta: str) -> str:
        self.text += delta
        if self.held:
            return ""
        end = self._safe_end()
        out, self.shown = self.text[self.shown : end], max(self.shown, end)
        return out

    def _safe_end(self) -> int:
        """How much of the text is content whatever comes next."""
        text = self.text
        if self.fmt is ToolFormat.LLAMA3_JSON:
            stripped = text.lstrip()
            if not stripped:
                return self.shown
            if stripped.startswith("{") or PYTHON_TAG.startswith(stripped[: len(PYTHON_TAG)]):
                if stripped.startswith("{") or stripped.startswith(PYTHON_TAG):
                    self.held = True
                return self.shown
            return len(text)
        marker = HERMES_OPEN if self.fmt is ToolFormat.HERMES else MISTRAL_OPEN
        at = text.find(marker)
        if at >= 0:
            self.held = True
            return at if text[:at].strip() else self.shown
        for keep in range(min(len(marker) - 1, len(text)), 0, -1):  # a marker's start
            if marker.startswith(text[-keep:]):
                return len(text) - keep
        return len(text) if text.strip() else self.shown

    def finish(self) -> tuple[str, list[ToolCall]]:
        """The content not yet shown, and the calls."""
        split = split_calls(self.fmt, self.text, self.tools, self.job_id)
        shown_up_to = self.shown
        if split.calls:
            content = split.content or ""
            return content[shown_up_to:] if len(content) > shown_up_to else "", split.calls
        return self.text[shown_up_to:], []
