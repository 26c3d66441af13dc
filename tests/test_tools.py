"""Tool calling below the gateway: each format's grammar, reading calls back (whole and
streamed), the prompt a template gets, and real engine runs whose forced calls always
validate against their schemas (tiny-random, in process)."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

from tokenfleet.grammar import _accepts, check
from tokenfleet.model import LoadedModel, load_model
from tokenfleet.model.chat import SIMPLE_CHAT_TEMPLATE
from tokenfleet.protocol import (
    ChatMessage,
    FunctionTool,
    GenerationRequest,
    NamedTool,
    SamplingParams,
    ToolCall,
)
from tokenfleet.reasons import FinishReason
from tokenfleet.tools import (
    CallStream,
    ToolFormat,
    chat_input,
    split_calls,
    tool_format,
    tool_grammar,
)
from tokenfleet.worker.engine import Engine, EngineConfig, Finished

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Rome", "Oslo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "metric": {"type": "boolean"},
    },
    "required": ["city", "days", "metric"],
    "additionalProperties": False,
}
ADD = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    "required": ["a", "b"],
    "additionalProperties": False,
}
TOOLS = [
    FunctionTool(name="get_weather", description="weather", parameters=json.dumps(WEATHER)),
    FunctionTool(name="add", parameters=json.dumps(ADD)),
]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
ASK = [ChatMessage(role="user", content="what is the weather in Paris?")]


def job(**fields: Any) -> GenerationRequest:
    return GenerationRequest(**{"messages": ASK, "tools": TOOLS, **fields})


def answers(fmt: ToolFormat) -> dict[str, str]:
    """One text per shape: a call alone, two calls, text then a call, plain text."""
    if fmt is ToolFormat.HERMES:
        one = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
        two = one + '\n<tool_call>\n{"name": "add", "arguments": {"a": 3, "b": 4}}\n</tool_call>'
    elif fmt is ToolFormat.MISTRAL:
        one = '[TOOL_CALLS][{"name": "add", "arguments": {"a": 1, "b": 2}}]'
        two = (
            '[TOOL_CALLS][{"name": "add", "arguments": {"a": 1, "b": 2}}, '
            '{"name": "add", "arguments": {"a": 3, "b": 4}}]'
        )
    else:
        one = '{"name": "add", "parameters": {"a": 1, "b": 2}}'
        two = '<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}}; ' + (
            '{"name": "add", "parameters": {"a": 3, "b": 4}}'
        )
    texted = "Let me add. " + one if fmt is not ToolFormat.LLAMA3_JSON else None
    out = {"one": one, "two": two, "plain": "It is sunny <b>today</b>."}
    if texted is not None:
        out["texted"] = texted
    return out


# ---- formats and grammars ---------------------------------------------------------------


def test_the_format_is_read_off_the_template() -> None:
    assert tool_format("{{ '<tool_call>' }}") is ToolFormat.HERMES
    assert tool_format("{{ '[TOOL_CALLS]' }}") is ToolFormat.MISTRAL
    assert tool_format("{{ '<|python_tag|>' }}{% if role == 'ipython' %}") is (
        ToolFormat.LLAMA3_JSON
    )
    assert tool_format(SIMPLE_CHAT_TEMPLATE) is ToolFormat.HERMES  # no format: Hermes
    assert tool_format(None) is ToolFormat.HERMES


@pytest.mark.parametrize("fmt", list(ToolFormat))
def test_each_choice_admits_exactly_its_shapes(fmt: ToolFormat) -> None:
    texts = answers(fmt)
    cases: list[tuple[Any, bool, set[str]]] = [
        ("auto", True, set(texts)),  # anything: text, calls, text then calls
        ("auto", False, set(texts) - {"two"}),
        ("required", True, {"one", "two"}),
        ("required", False, {"one"}),
        (NamedTool(name="add"), True, {"one"}),  # a named call is one call
    ]
    for choice, parallel, admitted in cases:
        spec = tool_grammar(job(tool_choice=choice, parallel_tool_calls=parallel), fmt)
        assert spec is not None
        grammar = check(spec)
        got = {name for name, text in texts.items() if _accepts(grammar, text)}
        assert got == admitted, (fmt, choice, parallel)


def test_arguments_off_the_schema_are_refused_by_the_grammar() -> None:
    spec = tool_grammar(job(tool_choice="required"), ToolFormat.HERMES)
    assert spec is not None
    grammar = check(spec)
    bad = [
        '<tool_call>\n{"name": "add", "arguments": {"a": "one", "b": 2}}\n</tool_call>',
        '<tool_call>\n{"name": "sub", "arguments": {"a": 1, "b": 2}}\n</tool_call>',
        '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>',
        '<tool_call>\n{"name": "get_weather", "arguments": '
        '{"city": "Lima", "days": 2, "metric": true}}\n</tool_call>',
    ]
    assert not any(_accepts(grammar, text) for text in bad)


def test_no_grammar_without_tools_or_with_choice_none() -> None:
    assert tool_grammar(GenerationRequest(messages=ASK), ToolFormat.HERMES) is None
    assert tool_grammar(job(tool_choice="none"), ToolFormat.HERMES) is None


def test_a_named_choice_must_be_among_the_tools_and_structured_output_excludes_calls() -> None:
    with pytest.raises(ValueError, match="not among the tools"):
        job(tool_choice=NamedTool(name="nope"))
    with pytest.raises(ValueError, match="cannot be combined"):
        job(structured={"kind": "json_object"})
    job(structured={"kind": "json_object"}, tool_choice="none")  # the tools only shown
    forced = job(structured={"kind": "json_object"}, tool_choice="required")
    assert tool_grammar(forced, ToolFormat.HERMES) is not None  # the call is the output


# ---- reading calls back -------------------------------------------------------------------


@pytest.mark.parametrize("fmt", list(ToolFormat))
def test_calls_are_read_back_and_the_stream_agrees_with_the_whole(fmt: ToolFormat) -> None:
    for name, text in answers(fmt).items():
        whole = split_calls(fmt, text, TOOLS, "job1")
        expected = {"one": 1, "two": 2, "texted": 1, "plain": 0}[name]
        assert len(whole.calls) == expected, (fmt, name)
        for c in whole.calls:
            jsonschema.validate(json.loads(c.arguments), SCHEMAS[c.name])
        if name == "texted":
            assert whole.content == "Let me add. "
        if name == "plain":
            assert whole.content == text
        for step in (1, 3, 7):  # token boundaries anywhere
            stream = CallStream(fmt, TOOLS, "job1")
            shown = "".join(stream.feed(text[i : i + step]) for i in range(0, len(text), step))
            rest, calls = stream.finish()
            assert calls == whole.calls
            assert shown + rest == (whole.content or "")


def test_a_call_cut_short_or_to_an_unknown_function_stays_content() -> None:
    cut = '<tool_call>\n{"name": "add", "arguments": {"a": 1'
    unknown = '<tool_call>\n{"name": "sub", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    trailing = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call> ok'
    for text in (cut, unknown, trailing):
        assert split_calls(ToolFormat.HERMES, text, TOOLS, "j").calls == []
        assert split_calls(ToolFormat.HERMES, text, TOOLS, "j").content == text


def test_whole_calls_before_one_the_length_cut_are_kept() -> None:
    whole = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
    text = whole + whole + '<tool_call>\n{"name": "add", "argu'
    split = split_calls(ToolFormat.HERMES, text, TOOLS, "j")
    assert [c.arguments for c in split.calls] == ['{"a": 1, "b": 2}'] * 2
    assert split.content is None
    stream = CallStream(ToolFormat.HERMES, TOOLS, "j")
    shown = "".join(stream.feed(text[i : i + 5]) for i in range(0, len(text), 5))
    assert shown == "" and stream.finish() == ("", split.calls)


def test_call_ids_are_the_same_on_every_read_and_differ_per_call() -> None:
    text = answers(ToolFormat.HERMES)["two"]
    first = split_calls(ToolFormat.HERMES, text, TOOLS, "job-a").calls
    again = split_calls(ToolFormat.HERMES, text, TOOLS, "job-a").calls
    other = split_calls(ToolFormat.HERMES, text, TOOLS, "job-b").calls
    assert [c.id for c in first] == [c.id for c in again]
    assert len({c.id for c in first}) == 2
    assert not {c.id for c in first} & {c.id for c in other}


# ---- into the prompt -----------------------------------------------------------------------

NATIVE = (
    "{% if tools %}TOOLS:{% for t in tools %}{{ t['function']['name'] }};{% endfor %}\n"
    "{% endif %}{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}CALL {{ c['function']['name'] }}"
    "{{ c['function']['arguments'] | tojson }}{% endfor %}{% endif %}"
    "{% if m.tool_call_id %}(for {{ m.tool_call_id }}){% endif %}\n{% endfor %}"
)
HISTORY = [
    ChatMessage(role="user", content="add 1 and 2"),
    ChatMessage(
        role="assistant",
        content="",
        tool_calls=[ToolCall(id="call_1", name="add", arguments='{"a": 1, "b": 2}')],
    ),
    ChatMessage(role="tool", content="3", tool_call_id="call_1"),
]


def test_a_template_that_renders_tools_gets_them_and_the_history_as_objects() -> None:
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    seen = chat_input(job(messages=HISTORY), NATIVE)
    assert seen.tools is not None and [t["function"]["name"] for t in seen.tools] == [
        "get_weather",
        "add",
    ]
    assert seen.turns[1]["tool_calls"][0]["function"]["arguments"] == {"a": 1, "b": 2}
    text = (
        ImmutableSandboxedEnvironment()
        .from_string(NATIVE)
        .render(messages=seen.turns, tools=seen.tools)
    )
    assert "TOOLS:get_weather;add;" in text
    assert 'CALL add{"a": 1, "b": 2}' in text and "(for call_1)" in text


def test_a_template_without_tools_gets_the_hermes_convention() -> None:
    seen = chat_input(job(messages=HISTORY), SIMPLE_CHAT_TEMPLATE)
    assert seen.tools is None
    system, user, assistant, result = seen.turns
    assert system["role"] == "system" and "<tools>" in system["content"]
    assert '"name": "get_weather"' in system["content"]
    assert user == {"role": "user", "content": "add 1 and 2"}
    assert assistant["content"] == (
        '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    )
    assert result == {"role": "user", "content": "<tool_response>\n3\n</tool_response>"}


# ---- the engine: forced calls validate ----------------------------------------------------


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    return load_model("tiny-random")


def run(loaded: LoadedModel, jobs: list[GenerationRequest]) -> dict[str, Finished]:
    eng = Engine(loaded, EngineConfig(max_active=32, max_batch_size=32, max_waiting=128))
    for j in jobs:
        assert eng.submit(j).accepted
    done: dict[str, Finished] = {}
    while eng.has_work:
        for f in eng.step().finished:
            done[f.job_id] = f
    return done


@pytest.mark.parametrize("choice", ["required", "named"])
def test_twenty_sampled_forced_calls_all_validate(tiny: LoadedModel, choice: str) -> None:
    picked: Any = NamedTool(name="get_weather") if choice == "named" else "required"
    jobs = [
        job(
            job_id=f"t{i}",
            max_new_tokens=200,
            sampling=SamplingParams(temperature=1.0, seed=i),
            tool_choice=picked,
            parallel_tool_calls=False,  # a random model would chain calls up to the limit
        )
        for i in range(20)
    ]
    done = run(tiny, jobs)
    names = set()
    for j in jobs:
        result = done[j.job_id].result
        assert result.finish_reason is FinishReason.STOP, result
        split = split_calls(ToolFormat.HERMES, result.text, TOOLS, j.job_id)
        assert split.calls and split.content is None, result.text
        for c in split.calls:
            jsonschema.validate(json.loads(c.arguments), SCHEMAS[c.name])
            names.add(c.name)
    if choice == "named":
        assert names == {"get_weather"}


def test_a_resumed_call_continues_to_the_same_valid_call(tiny: LoadedModel) -> None:
    one = job(
        job_id="r",
        max_new_tokens=200,
        sampling=SamplingParams(temperature=1.0, seed=3),
        tool_choice="required",
        parallel_tool_calls=False,
    )
    whole = run(tiny, [one])["r"].result
    eng = Engine(tiny, EngineConfig(max_active=4, max_batch_size=4, max_waiting=4))
    cut = len(whole.token_ids) // 2
    assert eng.submit(one, resume_ids=whole.token_ids[:cut]).accepted
    rest: list[int] = []
    while eng.has_work:
        rest += [e.token_id for e in eng.step().tokens]
    assert whole.token_ids[:cut] + rest == whole.token_ids
    assert split_calls(ToolFormat.HERMES, whole.text, TOOLS, "r").calls


def test_tools_on_a_prompt_job_are_refused_and_bad_parameters_named() -> None:
    with pytest.raises(ValueError, match="chat job"):
        GenerationRequest(prompt="x", tools=TOOLS)
    with pytest.raises(ValueError, match="parameters"):
        FunctionTool(name="f", parameters="[1]")
