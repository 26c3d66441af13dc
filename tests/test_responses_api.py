"""The Responses API (`/v1/responses`, issue 23) against a real redis-server, a real
worker process and uvicorn, driven by the official `openai` client: one job per
response through the chat pipeline, OpenAI's Response object and event stream, the
store (GET / DELETE / previous_response_id / store: false), tenants, cancel."""

from __future__ import annotations

import json
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from openai.types.responses import Response

from tests.helpers.gateway import GatewayEnv, gateway_env
from tokenfleet.model.chat import render_chat
from tokenfleet.model.presets import PRESETS
from tokenfleet.openai.models import ChatCompletionRequest

KEY_A, KEY_B = "key-a", "key-b"
env = gateway_env([("resp-w", [])], api_keys=(f"{KEY_A}=alpha", f"{KEY_B}=beta"))
Env = GatewayEnv

# The events of a streamed text answer, in OpenAI's order (deltas collapsed).
TEXT_EVENTS = [
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.content_part.added",
    "response.output_text.delta",
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
]
LONG = {"ignore_eos": True}  # tiny-random runs to max_output_tokens
YES_NO = {  # an answer tiny-random always finishes, under the grammar
    "type": "object",
    "properties": {"answer": {"enum": ["yes", "no"]}},
    "required": ["answer"],
    "additionalProperties": False,
}


def client(env: Env, key: str = KEY_A) -> openai.OpenAI:
    return env.gateway.client(key)


def raw(env: Env, method: str, path: str, key: str = KEY_A, **kw: Any) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"}
    return httpx.request(method, f"{env.gateway.url}{path}", headers=headers, timeout=60, **kw)


def prompt_tokens(messages: list[dict[str, str]]) -> int:
    tokenizer = PRESETS["tiny-random"].tokenizer()
    return len(tokenizer.encode(render_chat(tokenizer, messages)))


def collapsed(types: list[str]) -> list[str]:
    out: list[str] = []
    for t in types:
        if not (out and out[-1] == t == "response.output_text.delta"):
            out.append(t)
    return out


def test_create_is_a_response_object_and_get_returns_it(env: Env) -> None:
    c = client(env)
    made = c.responses.create(
        model="default",
        input="Hello there",
        instructions="be brief",
        max_output_tokens=8,
        temperature=0.0,
        metadata={"run": "1"},
        extra_body=LONG,
    )
    assert made.id.startswith("resp_") and made.object == "response"
    assert made.status == "incomplete"
    assert made.incomplete_details is not None
    assert made.incomplete_details.reason == "max_output_tokens"
    assert made.output_text and made.output[0].type == "message"
    assert made.usage is not None and made.usage.output_tokens == 8
    assert made.usage.total_tokens == made.usage.input_tokens + 8
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "Hello there"},
    ]
    assert made.usage.input_tokens == prompt_tokens(messages)
    assert made.instructions == "be brief" and made.metadata == {"run": "1"}

    body = raw(env, "GET", f"/v1/responses/{made.id}").json()
    Response.model_validate(body)  # every required field, in OpenAI's types
    again = c.responses.retrieve(made.id)
    assert again.model_dump() == made.model_dump()

    with pytest.raises(openai.NotFoundError):  # another tenant: not there at all
        client(env, KEY_B).responses.retrieve(made.id)
    with pytest.raises(openai.BadRequestError) as finished:
        c.responses.cancel(made.id)
    assert "not running" in str(finished.value)

    c.responses.delete(made.id)
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(made.id)


def test_streamed_events_in_order_and_equal_to_the_body(env: Env) -> None:
    c = client(env)
    args: dict[str, Any] = dict(
        model="default", input="Stream me", max_output_tokens=12, temperature=0.8
    )
    extra = {"seed": 5, **LONG}
    whole = c.responses.create(**args, extra_body=extra)
    events = list(c.responses.create(**args, stream=True, extra_body=extra))
    types = [e.type for e in events]
    assert collapsed(types) == [*TEXT_EVENTS, "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert "".join(deltas) == whole.output_text
    last = events[-1]
    assert last.type == "response.incomplete"
    assert last.response.output_text == whole.output_text
    assert last.response.usage is not None and last.response.usage.output_tokens == 12
    # stored before the last event was sent: a GET right after finds it
    assert c.responses.retrieve(last.response.id).output_text == whole.output_text

    # the client's stream helper needs a `response.completed`: an answer that ends itself
    fmt: Any = {"type": "json_schema", "name": "yes_no", "schema": YES_NO, "strict": True}
    with c.responses.stream(
        model="default", input="again", max_output_tokens=64, text={"format": fmt}
    ) as stream:
        texts = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert final.status == "completed"
    assert final.output_text == "".join(texts)
    assert json.loads(final.output_text)["answer"] in ("yes", "no")


def test_json_schema_output_validates(env: Env) -> None:
    schema = {
        "type": "object",
        "properties": {"colour": {"enum": ["red", "green"]}, "ok": {"type": "boolean"}},
        "required": ["colour", "ok"],
        "additionalProperties": False,
    }
    made = client(env).responses.create(
        model="default",
        input="pick a colour",
        max_output_tokens=64,
        text={"format": {"type": "json_schema", "name": "pick", "schema": schema, "strict": True}},
    )
    assert made.status == "completed"
    jsonschema.validate(json.loads(made.output_text), schema)
    assert made.text is not None and made.text.format is not None
    assert made.text.format.type == "json_schema"


def test_previous_response_id_continues_the_conversation(env: Env) -> None:
    c = client(env)
    first = c.responses.create(
        model="default", input="first turn", max_output_tokens=6, extra_body=LONG
    )
    second = c.responses.create(
        model="default",
        input=[{"role": "user", "content": [{"type": "input_text", "text": "second turn"}]}],
        previous_response_id=first.id,
        max_output_tokens=3,
        extra_body=LONG,
    )
    assert second.previous_response_id == first.id
    history = [
        {"role": "user", "content": "first turn"},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "second turn"},
    ]
    assert second.usage is not None
    assert second.usage.input_tokens == prompt_tokens(history)
    third = c.responses.create(
        model="default",
        input="third turn",
        previous_response_id=second.id,
        max_output_tokens=2,
        extra_body=LONG,
    )
    history += [
        {"role": "assistant", "content": second.output_text},
        {"role": "user", "content": "third turn"},
    ]
    assert third.usage is not None and third.usage.input_tokens == prompt_tokens(history)

    for key, previous in ((KEY_A, "resp_0123abcd"), (KEY_B, first.id)):
        with pytest.raises(openai.NotFoundError) as missing:
            client(env, key).responses.create(
                model="default", input="x", previous_response_id=previous, max_output_tokens=1
            )
        assert missing.value.body is not None
        assert missing.value.body["param"] == "previous_response_id"  # type: ignore[index]


def test_store_false_keeps_nothing(env: Env) -> None:
    c = client(env)
    made = c.responses.create(model="default", input="forget me", max_output_tokens=2, store=False)
    assert made.status in ("completed", "incomplete")
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(made.id)
    with pytest.raises(openai.NotFoundError):
        c.responses.create(
            model="default", input="x", previous_response_id=made.id, max_output_tokens=1
        )
    assert env.r.keys(f"tokenfleet:response:{made.id}") == []


def test_fields_accepted_ignored_and_refused(env: Env) -> None:
    ok = raw(
        env,
        "POST",
        "/v1/responses",
        json={
            "model": "default",
            "input": "hi",
            "max_output_tokens": 2,
            "truncation": "disabled",
            "include": [],
            "reasoning": {},
            "prompt_cache_key": "k",
            "safety_identifier": "u1",
            "store": False,
        },
    )
    assert ok.status_code == 200, ok.text
    Response.model_validate(ok.json())
    for body, param in (
        ({"background": True}, "background"),
        ({"truncation": "auto"}, "truncation"),
        ({"reasoning": {"effort": "high"}}, "reasoning.effort"),
        ({"max_output_tokens": 100_000}, "max_output_tokens"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"input": [{"type": "input_image", "image_url": "x"}]}, "input[0]"),
        ({"frobnicate": 1}, "frobnicate"),
    ):
        refused = raw(
            env, "POST", "/v1/responses", json={"model": "default", "input": "hi", **body}
        )
        assert refused.status_code == 400, (body, refused.text)
        assert refused.json()["error"]["param"] == param, refused.text


def test_cancel_a_streamed_response_mid_generation(env: Env) -> None:
    c = client(env)
    with c.responses.create(
        model="default", input="go on", max_output_tokens=2000, stream=True, extra_body=LONG
    ) as stream:
        response_id = None
        for event in stream:
            if event.type == "response.created":
                response_id = event.response.id
            if event.type == "response.output_text.delta":
                break  # a worker is generating it now
        assert response_id is not None
        with pytest.raises(openai.NotFoundError):
            client(env, KEY_B).responses.cancel(response_id)
        cancelled = c.responses.cancel(response_id)
        assert cancelled.status == "cancelled"
        rest = list(stream)
    assert rest[-1].type == "response.incomplete"
    assert rest[-1].response.status == "cancelled"
    usage = rest[-1].response.usage
    assert usage is not None and usage.output_tokens < 2000
    assert c.responses.retrieve(response_id).status == "cancelled"


tools_landed = pytest.mark.skipif(
    "tools" not in ChatCompletionRequest.model_fields,
    reason="the chat request does not carry tools yet",
)


@tools_landed
def test_a_required_function_tool_returns_a_function_call(env: Env) -> None:
    parameters = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}, "days": {"enum": [1, 2, 3]}},
        "required": ["city", "days"],
        "additionalProperties": False,
    }
    tool: Any = {"type": "function", "name": "forecast", "parameters": parameters, "strict": True}
    c = client(env)
    made = c.responses.create(
        model="default",
        input="weather in Paris?",
        tools=[tool],
        tool_choice="required",
        parallel_tool_calls=False,  # one call, then the answer ends
        max_output_tokens=200,
    )
    calls = [item for item in made.output if item.type == "function_call"]
    assert calls and made.status == "completed", made.model_dump_json()
    call = calls[0]
    assert call.name == "forecast" and call.call_id
    jsonschema.validate(json.loads(call.arguments), parameters)

    events = list(
        c.responses.create(
            model="default",
            input="weather in Paris?",
            tools=[tool],
            tool_choice="required",
            parallel_tool_calls=False,
            max_output_tokens=200,
            stream=True,
        )
    )
    assert [e.type for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    streamed = events[-1].response.output[0]
    assert streamed.type == "function_call"
    jsonschema.validate(json.loads(streamed.arguments), parameters)

    answered = c.responses.create(
        model="default",
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}],
        previous_response_id=made.id,
        tools=[tool],
        tool_choice="none",
        max_output_tokens=4,
    )
    assert answered.output[0].type == "message"
