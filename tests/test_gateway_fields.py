"""Which request fields the gateway honours, ignores or refuses, vLLM's structured-output
fields, and the routes around the completions (a model's card, unknown routes,
embeddings) — against a real redis-server, a real worker process (tiny-random) and the
gateway in uvicorn, driven by the official `openai` client and raw httpx.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from tests.helpers.gateway import GatewayEnv, gateway_env
from tokenfleet.openai.fields import IGNORED, IGNORED_HEADER, REFUSED
from tokenfleet.openai.models import ChatCompletionRequest, CompletionRequest

Env = GatewayEnv
env = gateway_env([("gf-main", [])])

CHAT: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hi"}]
SERVICE_LOG = "tokenfleet.gateway.service"
HARMLESS: dict[str, Any] = {
    "store": False,
    "metadata": {"team": "search"},
    "prompt_cache_key": "k-1",
    "safety_identifier": "u-42",
    "stream_options": {"include_usage": True, "include_obfuscation": False, "later": 1},
}


def ignored_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == SERVICE_LOG and r.levelno == logging.WARNING and "ignored" in r.getMessage()
    ]


# ---- ignored fields: accepted, named in a header and one log line ----------------------


def test_harmless_fields_are_accepted_named_in_the_header_and_logged_once(
    env: Env, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger=SERVICE_LOG)
    client = env.gateway.client()
    raw = client.chat.completions.with_raw_response.create(
        model="default",
        messages=CHAT,
        max_tokens=4,
        user="alice",
        extra_body={k: v for k, v in HARMLESS.items() if k != "stream_options"},
    )
    named = "store, metadata, prompt_cache_key, safety_identifier"
    assert raw.headers[IGNORED_HEADER] == named
    assert raw.parse().choices[0].message.content is not None
    job_id = raw.headers["x-tokenfleet-job-id"]
    assert ignored_warnings(caplog) == [
        f"POST /v1/chat/completions: ignored fields {named} (job {job_id})"
    ]

    caplog.clear()
    # ignore_eos (honoured, so not named): a random model may sample EOS first, and the
    # usage chunk must count tokens that were really streamed
    body = {
        "model": "default",
        "messages": CHAT,
        "max_tokens": 4,
        "ignore_eos": True,
        "stream": True,
        **HARMLESS,
    }
    with (
        httpx.Client(timeout=60) as http,
        http.stream("POST", f"{env.gateway.url}/v1/chat/completions", json=body) as reply,
    ):
        lines = [line for line in reply.iter_lines() if line.startswith("data: ")]
    assert reply.status_code == 200
    streamed = named + ", stream_options.include_obfuscation, stream_options.later"
    assert reply.headers[IGNORED_HEADER] == streamed
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2][6:])["usage"]["completion_tokens"] == 4  # include_usage
    assert len(ignored_warnings(caplog)) == 1
    assert streamed in ignored_warnings(caplog)[0]


def test_a_request_with_nothing_ignored_has_no_header_and_no_log_line(
    env: Env, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger=SERVICE_LOG)
    raw = env.gateway.client().completions.with_raw_response.create(
        model="default",
        prompt="hi",
        max_tokens=2,
        user="bob",
        stream_options={"include_usage": True},
        extra_body={"logprobs": 0, "echo": False},
    )
    assert IGNORED_HEADER.lower() not in raw.headers
    assert raw.parse().choices[0].text is not None
    assert ignored_warnings(caplog) == []


@pytest.mark.parametrize(
    "defaults",
    [
        {"logprobs": False},
        {"logprobs": False, "top_logprobs": 0},  # vLLM accepts 0 without logprobs too
        {"top_logprobs": 0},
    ],
)
def test_logprob_defaults_pass_on_chat(env: Env, defaults: dict[str, Any]) -> None:
    """What clients send as defaults asks for nothing: no 400, nothing named ignored."""
    raw = env.gateway.client().chat.completions.with_raw_response.create(
        model="default", messages=CHAT, max_tokens=2, **defaults
    )
    assert IGNORED_HEADER.lower() not in raw.headers
    assert raw.parse().choices[0].finish_reason in ("stop", "length")


# ---- refused fields: a 400 naming the field --------------------------------------------


def test_metadata_errors_name_metadata_never_user(env: Env) -> None:
    """`metadata` was a 400 naming `user`, which was not sent: the protocol's rename of a
    job's `metadata` (where `user` goes) was applied to the OpenAI request's own field."""
    url = f"{env.gateway.url}/v1/chat/completions"
    base = {"model": "default", "messages": CHAT, "max_tokens": 2}
    with httpx.Client(timeout=60) as http:
        fine = http.post(url, json={**base, "metadata": {"a": "b"}})
        assert fine.status_code == 200, fine.text
        for bad in ("not an object", {"a": 1}):
            reply = http.post(url, json={**base, "metadata": bad})
            assert reply.status_code == 400, reply.text
            error = reply.json()["error"]
            assert error["param"].startswith("metadata"), error
            assert "user" not in error["message"], error
        too_long = http.post(url, json={**base, "user": "u" * 2000})
        assert too_long.status_code == 400
        assert too_long.json()["error"]["param"] == "user"


@pytest.mark.parametrize(
    ("route", "field", "value", "code", "words"),
    [
        ("completions", "frobnicate", 1, "unknown_parameter", "neither an OpenAI parameter"),
        ("chat", "frobnicate", 1, "unknown_parameter", "not permitted"),
        ("chat", "min_p", 0.1, "unsupported_parameter", REFUSED["min_p"]),
        ("chat", "modalities", ["audio"], "unsupported_parameter", REFUSED["modalities"]),
        ("chat", "reasoning_effort", "low", "unsupported_parameter", REFUSED["reasoning_effort"]),
        ("completions", "store", True, "unknown_parameter", "not permitted"),  # chat's only
        ("chat", "store", "yes", "invalid_value", "valid boolean"),  # ignored, still typed
    ],
)
def test_fields_the_fleet_would_not_honour_are_400_naming_them(
    env: Env, route: str, field: str, value: object, code: str, words: str
) -> None:
    body: dict[str, Any] = {"model": "default", "max_tokens": 2, field: value}
    body |= {"messages": CHAT} if route == "chat" else {"prompt": "hi"}
    path = "/v1/chat/completions" if route == "chat" else "/v1/completions"
    reply = httpx.post(f"{env.gateway.url}{path}", json=body, timeout=60)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert (error["param"], error["code"], error["type"]) == (field, code, "invalid_request_error")
    assert error["message"].startswith(f"{field}: ")
    assert words in error["message"]


def test_an_unknown_key_inside_a_structured_outputs_object_is_named(env: Env) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        env.gateway.client().completions.create(
            model="default",
            prompt="x",
            max_tokens=2,
            extra_body={"structured_outputs": {"regex": "a", "backend": "xgrammar"}},
        )
    assert (refused.value.param, refused.value.code) == (
        "structured_outputs.backend",
        "unknown_parameter",
    )


# ---- vLLM's structured-output fields ---------------------------------------------------

CHOICES = ["yes", "no", "a.b (c)", "x|y+"]  # regex specials are literal
SCHEMA = {
    "type": "object",
    "properties": {"pick": {"enum": ["a", "b"]}, "n": {"type": "integer", "maximum": 9}},
    "required": ["pick", "n"],
    "additionalProperties": False,
}


def test_guided_choice_and_structured_outputs_choice_return_one_of_the_choices(
    env: Env,
) -> None:
    client = env.gateway.client()
    seen = set()
    for seed in range(6):
        for field in ("guided_choice", "structured_outputs"):
            value: object = CHOICES if field == "guided_choice" else {"choice": CHOICES}
            text = (
                client.completions.create(
                    model="default",
                    prompt=f"pick {seed}",
                    max_tokens=12,
                    temperature=1.0,
                    seed=seed,
                    extra_body={field: value},
                )
                .choices[0]
                .text
            )
            assert text in CHOICES, (field, text)
            seen.add(text)
    chat = client.chat.completions.create(
        model="default",
        messages=CHAT,
        max_tokens=12,
        seed=1,
        extra_body={"guided_choice": CHOICES},
    )
    assert chat.choices[0].message.content in CHOICES
    assert len(seen) > 1  # the choice is the model's, not always the first


@pytest.mark.parametrize(
    "extra",
    [
        {"guided_json": SCHEMA},
        {"guided_json": json.dumps(SCHEMA)},
        {"structured_outputs": {"json": SCHEMA}},
        {"structured_outputs": {"json": json.dumps(SCHEMA)}},
    ],
    ids=[
        "guided_json",
        "guided_json-text",
        "structured_outputs.json",
        "structured_outputs.json-text",
    ],
)
def test_json_schemas_in_vllm_fields_are_enforced(env: Env, extra: dict[str, Any]) -> None:
    import jsonschema  # type: ignore[import-untyped]

    reply = env.gateway.client().chat.completions.create(
        model="default",
        messages=CHAT,
        max_tokens=60,
        temperature=1.0,
        seed=2,
        extra_body=extra,
    )
    assert reply.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(reply.choices[0].message.content or ""), SCHEMA)


def test_structured_outputs_regex_grammar_and_json_object(env: Env) -> None:
    client = env.gateway.client()

    def text(constraint: dict[str, Any], max_tokens: int = 30) -> str:
        reply = client.completions.create(
            model="default",
            prompt="x",
            max_tokens=max_tokens,
            temperature=1.0,
            seed=4,
            extra_body={"structured_outputs": constraint},
        )
        assert reply.choices[0].finish_reason == "stop", reply
        return reply.choices[0].text

    assert re.fullmatch("(yes|no)-[0-9]{2}", text({"regex": "(yes|no)-[0-9]{2}"}))
    assert re.fullmatch("ab+", text({"grammar": 'start: "a" B\nB: /b+/'}))
    assert isinstance(json.loads(text({"json_object": True}, max_tokens=200)), dict)


def test_two_constraints_or_none_in_structured_outputs_are_400_naming_them(env: Env) -> None:
    url = f"{env.gateway.url}/v1/completions"
    base = {"model": "default", "prompt": "x", "max_tokens": 2}
    cases: list[tuple[dict[str, Any], str | None, str]] = [
        (
            {"guided_choice": ["a"], "structured_outputs": {"regex": "a"}},
            None,
            "structured_outputs and guided_choice each constrain the output: give one of",
        ),
        (
            {"structured_outputs": {"regex": "a", "choice": ["a"]}},
            "structured_outputs",
            "regex, choice",
        ),
        ({"structured_outputs": {"json_object": False}}, "structured_outputs", "given: none"),
        ({"guided_json": "[1, 2]"}, "guided_json", "must be a JSON object"),
        ({"guided_choice": []}, "guided_choice", "at least 1 item"),
    ]
    with httpx.Client(timeout=60) as http:
        for extra, param, words in cases:
            reply = http.post(url, json={**base, **extra})
            assert reply.status_code == 400, (extra, reply.text)
            error = reply.json()["error"]
            assert (error["param"], error["code"]) == (param, "invalid_value"), error
            assert words in error["message"], error


# ---- routes ----------------------------------------------------------------------------


def test_a_models_card_and_an_unserved_one(env: Env) -> None:
    client = env.gateway.client()
    listed = {m.id: m for m in client.models.list().data}
    card = client.models.retrieve("default")
    assert card == listed["default"]
    assert card.model_extra is not None and card.model_extra["workers"] == 1
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("nope")
    assert (missing.value.code, missing.value.param) == ("model_not_found", "model")
    assert "'nope'" in missing.value.message and "served: default" in missing.value.message


def test_unknown_routes_and_methods_answer_openai_style_errors(env: Env) -> None:
    with httpx.Client(base_url=env.gateway.url, timeout=30) as http:
        for method, path in [("GET", "/v1/nothing"), ("DELETE", "/v2/chat"), ("POST", "/")]:
            reply = http.request(method, path)
            assert reply.status_code == 404, reply.text
            error = reply.json()["error"]
            assert (error["type"], error["param"], error["code"]) == (
                "invalid_request_error",
                None,
                "unknown_route",
            )
            assert error["message"].startswith(f"no route {method} {path}; the gateway serves ")
            for served in ("POST /v1/completions", "POST /v1/chat/completions", "GET /v1/models"):
                assert served in error["message"]
        wrong = http.get("/v1/completions")
        assert wrong.status_code == 405
        assert wrong.headers["allow"] == "POST"
        error = wrong.json()["error"]
        assert (error["type"], error["code"]) == ("invalid_request_error", "method_not_allowed")
        assert "GET" in error["message"] and "allowed: POST" in error["message"]


def test_embeddings_are_a_clear_400_not_a_404(env: Env) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        env.gateway.client().embeddings.create(model="default", input="hello")
    assert (refused.value.code, refused.value.param) == ("model_not_embedding", "model")
    assert "generate text" in refused.value.message
    assert "default" in refused.value.message


# ---- docs/http.md's table says what the code does ---------------------------------------


def field_rows() -> dict[str, str]:
    """docs/http.md's "Request fields" table: each backticked field name → its status."""
    text = (Path(__file__).parents[1] / "docs" / "http.md").read_text()
    section = text.split("### Request fields", 1)[1].split("\n### ", 1)[0]
    rows: dict[str, str] = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if line.startswith("| `") and len(cells) == 4:
            for name in re.findall(r"`([^`]+)`", cells[0]):
                rows[name] = f"{cells[2]} | {cells[3]}"
    return rows


def test_the_docs_table_names_every_field_with_the_codes_status() -> None:
    rows = field_rows()
    for name, why in IGNORED.items():
        assert rows.get(name) == f"ignored | {why}", name
    for name, why in REFUSED.items():
        assert rows.get(name) == f"refused | {why}", name
    documented_ignored = {n for n, row in rows.items() if row.startswith("ignored")}
    assert documented_ignored == set(IGNORED) | {"stream_options.*"}
    for model in (CompletionRequest, ChatCompletionRequest):
        for name, info in model.model_fields.items():
            field = info.alias or name
            named = [row for row in rows if row == field or row.startswith(f"{field}.")]
            assert named, f"{model.__name__}.{field} is not in the table"
            assert name not in REFUSED, f"{name} is a field now: take it out of REFUSED"
