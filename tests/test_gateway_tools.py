"""Tool calling end to end (issue 23): the official `openai` client against the gateway,
a real redis-server and real tiny-random worker processes.

tiny-random's chat template has no tool format of its own, so the Hermes convention
applies (the functions in the system turn, calls as `<tool_call>` blocks). Its weights
are random: the schemas here bound every value (enums, integers with a range, booleans,
strings with a maxLength) so a call ends well within max_tokens, and forced calls ask
for one call (`parallel_tool_calls=False`), or a random model chains calls to the limit.

Call ids are `tools.call_id(job_id, index)`: two requests are two jobs, so the same
seed gives the same name and arguments, not the same ids; each id is checked against
the job it came from (the `chatcmpl-<job id>` of its response).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest
import redis

from tests.helpers.gateway import GatewayEnv, ServedGateway, gateway_env, run_batch
from tests.helpers.support import KEYS, wait_for
from tests.helpers.workers import Fleet
from tokenfleet.gateway import GatewayConfig
from tokenfleet.local import RedisServer
from tokenfleet.protocol import decode_result
from tokenfleet.tools import HERMES_CLOSE, HERMES_OPEN, call_id

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "metric": {"type": "boolean"},
    },
    "required": ["city", "days", "metric"],
    "additionalProperties": False,
}
NOTE = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 16},
        "urgent": {"type": "boolean"},
        "stars": {"type": "integer", "minimum": 0, "maximum": 5},
    },
    "required": ["title", "urgent", "stars"],
    "additionalProperties": False,
}
# the crash test's: a call of a few hundred tokens, long enough to kill a worker mid-way
REPORT = {
    "type": "object",
    "properties": {
        "summary": {"type": "string", "minLength": 120, "maxLength": 160},
        "mood": {"type": "string", "enum": ["calm", "stormy", "sunny"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["summary", "mood", "count"],
    "additionalProperties": False,
}
SCHEMAS: dict[str, dict[str, Any]] = {"get_weather": WEATHER, "add_note": NOTE, "report": REPORT}


def tool(name: str) -> dict[str, Any]:
    """An OpenAI `tools` entry (strict: the client's stream helper parses only those)."""
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": f"the {name} function",
            "parameters": SCHEMAS[name],
            "strict": True,
        },
    }


TOOLS = [tool("get_weather"), tool("add_note")]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER_CHOICE = {"type": "function", "function": {"name": "get_weather"}}
MAX_TOKENS = 300  # a bounded call is ~100 tokens here (one per byte)

Env = GatewayEnv
# one worker; no queue timeout: twenty jobs at once on a shared CI machine may queue long
env = gateway_env([("tools-w", ["--max-active", "24", "--max-batch", "24"])], queue_timeout_s=0)


def check_calls(calls: Any, job_id: str, allowed: set[str]) -> list[tuple[str, str]]:
    """Every call is to one of `allowed`, its arguments valid for that function's
    schema, its id the job's; returns (name, arguments) per call."""
    assert calls, "no tool calls"
    out = []
    for i, call in enumerate(calls):
        assert call.type == "function"
        assert call.function.name in allowed, call.function.name
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
        assert call.id == call_id(job_id, i)
        out.append((call.function.name, call.function.arguments))
    return out


def job_of(response_id: str) -> str:
    assert response_id.startswith("chatcmpl-"), response_id
    return response_id.removeprefix("chatcmpl-")


def streamed_calls(chunks: list[Any]) -> dict[int, dict[str, str]]:
    """The calls of a chat stream, by index, as the client's stream helpers accumulate
    them: the id from the delta that carries it, name and arguments joined."""
    by_index: dict[int, dict[str, str]] = {}
    for chunk in chunks:
        if not chunk.choices:
            continue
        for d in chunk.choices[0].delta.tool_calls or []:
            acc = by_index.setdefault(d.index, {"id": "", "name": "", "arguments": ""})
            acc["id"] = d.id or acc["id"]
            if d.function is not None:
                acc["name"] += d.function.name or ""
                acc["arguments"] += d.function.arguments or ""
    return by_index


# ---- 1. forced calls -----------------------------------------------------------------------


@pytest.mark.parametrize("choice", ["named", "required"])
def test_twenty_sampled_forced_calls_validate(env: Env, choice: str) -> None:
    client = env.gateway.client()
    tool_choice: Any = WEATHER_CHOICE if choice == "named" else "required"

    def ask(seed: int) -> Any:
        return client.chat.completions.create(
            model="default",
            messages=ASK,
            tools=TOOLS,
            tool_choice=tool_choice,
            parallel_tool_calls=False,
            temperature=1.0,
            seed=seed,
            max_tokens=MAX_TOKENS,
        )

    with ThreadPoolExecutor(max_workers=20) as pool:
        answers = list(pool.map(ask, range(20)))
    names = set()
    for answer in answers:
        picked = answer.choices[0]
        assert picked.finish_reason == "tool_calls", picked
        assert picked.message.content is None
        allowed = {"get_weather"} if choice == "named" else set(SCHEMAS) - {"report"}
        calls = check_calls(picked.message.tool_calls, job_of(answer.id), allowed)
        assert len(calls) == 1  # parallel_tool_calls=False
        names |= {name for name, _ in calls}
    if choice == "named":
        assert names == {"get_weather"}


def test_a_forced_call_cut_by_max_tokens_is_no_call_but_its_text(env: Env) -> None:
    """A call cut short (`length`) is not a call: the partial block stays content."""
    answer = env.gateway.client().chat.completions.create(
        model="default",
        messages=ASK,
        tools=TOOLS,
        tool_choice=WEATHER_CHOICE,
        temperature=1.0,
        seed=3,
        max_tokens=20,
    )
    picked = answer.choices[0]
    assert picked.finish_reason == "length"
    assert picked.message.tool_calls is None
    forced = f'{HERMES_OPEN}\n{{"name": "get_weather", "arguments": {{"city": "'
    assert picked.message.content == forced[:20]  # one token per byte, all of them forced


# ---- 2. a two-turn tool loop -------------------------------------------------------------


def test_a_tool_loop_sends_the_call_and_its_result_back_to_the_template(env: Env) -> None:
    client = env.gateway.client()
    first = client.chat.completions.create(
        model="default",
        messages=ASK,
        tools=TOOLS,
        tool_choice=WEATHER_CHOICE,
        temperature=0.0,
        max_tokens=MAX_TOKENS,
    )
    call = first.choices[0].message.tool_calls[0]
    check_calls([call], job_of(first.id), {"get_weather"})
    result = json.dumps({"temperature_c": 21, "sky": "clear"})
    history = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.function.name, "arguments": call.function.arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call.id, "content": result},
    ]
    second = client.chat.completions.create(
        model="default",
        messages=history,
        tools=TOOLS,
        tool_choice="none",
        temperature=0.0,
        max_tokens=16,
    )
    answer = second.choices[0]
    assert answer.message.tool_calls is None
    assert isinstance(answer.message.content, str)
    assert answer.finish_reason in ("stop", "length")
    # the byte tokenizer: one token per byte. The second prompt holds the first one's
    # turns plus the call (as a Hermes block) and the result (as a tool response)
    block = json.dumps(
        {"name": call.function.name, "arguments": json.loads(call.function.arguments)}
    )
    rendered = f"{HERMES_OPEN}\n{block}\n{HERMES_CLOSE}<tool_response>\n{result}\n</tool_response>"
    assert first.usage is not None and second.usage is not None
    assert second.usage.prompt_tokens - first.usage.prompt_tokens >= len(rendered.encode())


# ---- 3. streaming --------------------------------------------------------------------------


def test_a_streamed_forced_call_equals_the_whole_one(env: Env) -> None:
    client = env.gateway.client()
    args: dict[str, Any] = dict(
        model="default",
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=1.0,
        seed=11,
        max_tokens=MAX_TOKENS,
    )
    whole = client.chat.completions.create(**args)
    expected = check_calls(whole.choices[0].message.tool_calls, job_of(whole.id), set(SCHEMAS))

    chunks = list(client.chat.completions.create(**args, stream=True))
    streamed_job = job_of(chunks[0].id)
    by_index = streamed_calls(chunks)
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == ""  # nothing of the call leaked as text
    assert sorted(by_index) == list(range(len(expected)))
    got = [(by_index[i]["name"], by_index[i]["arguments"]) for i in sorted(by_index)]
    assert got == expected
    assert [by_index[i]["id"] for i in sorted(by_index)] == [
        call_id(streamed_job, i) for i in sorted(by_index)
    ]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"

    # the client's own stream helper parses it (strict tools: it parses their arguments)
    with client.chat.completions.stream(**args) as stream:
        done = [e for e in stream if e.type == "tool_calls.function.arguments.done"]
        final = stream.get_final_completion()
    assert [(e.name, e.arguments) for e in done] == expected
    assert [e.parsed_arguments for e in done] == [json.loads(a) for _, a in expected]
    message = final.choices[0].message
    assert final.choices[0].finish_reason == "tool_calls"
    assert message.tool_calls is not None
    assert [(c.function.name, c.function.arguments) for c in message.tool_calls] == expected
    assert [c.function.parsed_arguments for c in message.tool_calls] == [
        json.loads(a) for _, a in expected
    ]


# ---- 4. auto ----------------------------------------------------------------------------


def test_auto_gives_content_or_valid_calls_never_a_broken_call(env: Env) -> None:
    client = env.gateway.client()

    def ask(seed: int) -> Any:
        return client.chat.completions.create(
            model="default",
            messages=ASK,
            tools=TOOLS,
            tool_choice="auto",
            parallel_tool_calls=False,
            temperature=1.0,
            seed=seed,
            max_tokens=64,
        )

    with ThreadPoolExecutor(max_workers=10) as pool:
        answers = list(pool.map(ask, range(10)))
    for answer in answers:
        picked = answer.choices[0]
        if picked.finish_reason == "tool_calls":
            check_calls(picked.message.tool_calls, job_of(answer.id), set(SCHEMAS) - {"report"})
            text = picked.message.content
            assert text is None or HERMES_OPEN not in text
        else:
            assert picked.finish_reason in ("stop", "length")
            assert picked.message.tool_calls is None
            assert isinstance(picked.message.content, str)
            # a call once opened is held to its schema: only a cut (length) leaves one
            # unfinished in the text
            assert HERMES_OPEN not in picked.message.content or picked.finish_reason == "length"


# ---- 5. what is accepted and what is refused ---------------------------------------------


def test_no_tools_and_choice_none_are_plain_answers_and_bad_choices_are_400(env: Env) -> None:
    client = env.gateway.client()
    plain = dict(model="default", messages=ASK, max_tokens=8, temperature=0.0)
    for extra in ({"tools": []}, {"tool_choice": "none"}, {"tools": [], "tool_choice": "none"}):
        answer = client.chat.completions.create(**plain, **extra)
        assert answer.choices[0].finish_reason in ("stop", "length"), extra
        assert answer.choices[0].message.tool_calls is None
        assert isinstance(answer.choices[0].message.content, str)

    missing = {"type": "function", "function": {"name": "launch_rocket"}}
    with pytest.raises(openai.BadRequestError) as named:
        client.chat.completions.create(**plain, tools=TOOLS, tool_choice=missing)
    assert "launch_rocket" in named.value.message
    with pytest.raises(openai.BadRequestError) as unnamed:
        client.chat.completions.create(**plain, tool_choice=missing)  # no tools at all
    assert "launch_rocket" in unnamed.value.message
    with pytest.raises(openai.BadRequestError) as required:
        client.chat.completions.create(**plain, tool_choice="required")
    assert "required" in required.value.message
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(**plain, tools=[], tool_choice="required")


# ---- 6. the Batch API --------------------------------------------------------------------


def test_a_batch_of_forced_calls_returns_valid_calls(env: Env) -> None:
    client = env.gateway.client()
    lines = [
        {
            "custom_id": f"call-{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": "default",
                "messages": ASK,
                "tools": TOOLS,
                "tool_choice": WEATHER_CHOICE if i % 2 else "required",
                "parallel_tool_calls": False,
                "temperature": 1.0,
                "seed": 100 + i,
                "max_tokens": MAX_TOKENS,
            },
        }
        for i in range(4)
    ]
    done, out = run_batch(client, lines)
    assert done.status == "completed", done.errors
    assert done.request_counts.completed == 4 and done.output_file_id
    assert [line["custom_id"] for line in out] == [f"call-{i}" for i in range(4)]
    for i, line in enumerate(out):
        assert line["error"] is None and line["response"]["status_code"] == 200
        body = line["response"]["body"]
        choice = body["choices"][0]
        assert choice["finish_reason"] == "tool_calls"
        assert choice["message"]["content"] is None
        calls = choice["message"]["tool_calls"]
        assert len(calls) == 1
        for index, c in enumerate(calls):
            allowed = {"get_weather"} if i % 2 else {"get_weather", "add_note"}
            assert c["type"] == "function" and c["function"]["name"] in allowed
            arguments = json.loads(c["function"]["arguments"])
            jsonschema.validate(arguments, SCHEMAS[c["function"]["name"]])
            assert c["id"] == call_id(job_of(body["id"]), index)


# ---- 7. a worker killed mid-call --------------------------------------------------------


CrashFleet = tuple[redis.Redis, Fleet, ServedGateway]


@pytest.fixture
def crash_fleet(own_redis: RedisServer, tmp_path: Path) -> Iterator[CrashFleet]:
    """A Redis of the test's own (no other worker may take its job), a client of it, a
    fleet on it with no worker yet, and a gateway in front."""
    r = redis.Redis.from_url(own_redis.url)
    fleet = Fleet(own_redis.url, tmp_path)
    gateway = ServedGateway(
        GatewayConfig(redis_url=own_redis.url, fleet_cache_s=0.0, queue_timeout_s=0)
    )
    try:
        yield r, fleet, gateway
    finally:
        gateway.stop()
        fleet.stop_all()
        r.close()


@pytest.mark.fault
def test_a_call_cut_by_a_kill9_resumes_on_another_worker_to_the_same_call(
    crash_fleet: CrashFleet,
) -> None:
    """One worker streams a long forced call; once it is inside the call (60 tokens out
    of ~300) it is SIGKILLed and a second worker starts. The second claims the orphan
    when the first's heartbeat expires and resumes after its published tokens: the
    stream goes on to a valid call, the one the same request gets uninterrupted."""
    r, fleet, gateway = crash_fleet
    client = gateway.client()
    args: dict[str, Any] = dict(
        model="default",
        messages=[{"role": "user", "content": "Write the report."}],
        tools=[tool("report"), tool("get_weather")],
        tool_choice={"type": "function", "function": {"name": "report"}},
        temperature=1.0,
        seed=5,
        max_tokens=700,  # ~1 token per byte; a multi-byte character counts once in maxLength
    )
    first = fleet.start("crash-w1", burst=False)
    fleet.wait_alive(first)

    stream = client.chat.completions.create(**args, stream=True)
    job_id = stream.response.headers["x-tokenfleet-job-id"]
    chunks: list[Any] = []
    failure: list[BaseException] = []

    def read() -> None:
        try:
            chunks.extend(stream)
        except BaseException as exc:  # handed to the test thread
            failure.append(exc)

    reader = threading.Thread(target=read)
    reader.start()
    try:
        wait_for(lambda: r.xlen(KEYS.events(job_id)) >= 60, 120, f"tokens of {job_id}")
        first.kill()
        out_at_kill = r.xlen(KEYS.events(job_id))
        assert not r.exists(KEYS.result(job_id)), f"{job_id} ended before the kill"
        second = fleet.start("crash-w2", burst=False)
        fleet.wait_alive(second)
        reader.join(180)
        assert not reader.is_alive(), "the stream did not end after the resume"
        assert not failure, failure
    finally:
        reader.join(5)
    raw = r.get(KEYS.result(job_id))
    assert raw is not None
    result = decode_result(raw)
    assert result.worker == "crash-w2"
    assert result.usage.completion_tokens > out_at_kill  # it went on from where it was cut

    streamed = streamed_calls(chunks)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    assert list(streamed) == [0]
    jsonschema.validate(json.loads(streamed[0]["arguments"]), REPORT)
    assert streamed[0]["id"] == call_id(job_id, 0)

    # the same request, uninterrupted (on the surviving worker): the same call
    whole = client.chat.completions.create(**args)
    reference = check_calls(whole.choices[0].message.tool_calls, job_of(whole.id), {"report"})
    assert [(streamed[0]["name"], streamed[0]["arguments"])] == reference
