"""The HTTP gateway against a real redis-server, real worker processes and uvicorn, driven
by the official `openai` client and raw httpx.

One fleet for the whole module (starting a worker costs seconds): `gw-main` serves
the default stream with tiny-random (which has a chat template); `gw-plain` serves
the model name `plain` from a checkpoint folder with no chat template and a 1 MiB
KV budget, so it refuses big jobs. Tests here use their own Redis client and never
the flushing `redis_url` fixture, which would wipe the workers' state mid-module.
"""

from __future__ import annotations

import json
import re
import socket
from pathlib import Path

import httpx
import openai
import pytest

from tests.helpers.gateway import (
    GatewayEnv,
    ServedGateway,
    WorkerSpec,
    gateway_env,
    worker_info,
)
from tests.helpers.support import KEYS, wait_for
from tokenfleet.gateway import GatewayConfig
from tokenfleet.keys import Keys
from tokenfleet.local import RedisServer
from tokenfleet.model.chat import render_chat
from tokenfleet.model.presets import PRESETS
from tokenfleet.producer import Producer
from tokenfleet.protocol import MAX_PROMPT_CHARS


def plain_checkpoint(folder: Path) -> Path:
    """tiny-random's weights as a checkpoint folder with a word-level tokenizer.json and
    no chat template (so `messages` must be refused)."""
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models, pre_tokenizers

    preset = PRESETS["tiny-random"]
    c = preset.config
    folder.mkdir(parents=True)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
        "max_position_embeddings": c.max_position_embeddings,
        "rope_theta": c.rope_theta,
        "rms_norm_eps": c.rms_norm_eps,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    (folder / "config.json").write_text(json.dumps(config))
    weights = {name: t.contiguous() for name, t in preset.hf_weights().items()}
    save_file(weights, folder / "model.safetensors")
    vocab = {"[UNK]": 0, "<s>": 1, "</s>": 2}
    vocab |= {f"w{i}": i for i in range(3, c.vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(folder / "tokenizer.json"))
    return folder


def module_workers(tmp: Path) -> list[WorkerSpec]:
    plain = plain_checkpoint(tmp / "plain")
    return [
        ("gw-main", []),
        ("gw-plain", ["--model", str(plain), "--model-name", "plain", "--kv-mb", "1"]),
    ]


Env = GatewayEnv
env = gateway_env(module_workers)


def metrics_of(gateway: ServedGateway) -> str:
    return httpx.get(f"{gateway.url}/metrics", timeout=30).text


# ---- the OpenAI client ------------------------------------------------------------


@pytest.mark.parametrize("sampling", [{"temperature": 0.9, "seed": 7}, {"temperature": 0.0}])
def test_streamed_completion_equals_the_json_one(env: Env, sampling: dict[str, float]) -> None:
    client = env.gateway.client()
    args = dict(model="default", prompt="Hello, gateway!", max_tokens=20, **sampling)
    whole = client.completions.create(**args, extra_body={"ignore_eos": True})
    chunks = list(
        client.completions.create(
            **args,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    assert streamed == whole.choices[0].text
    assert whole.choices[0].finish_reason == "length"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert whole.usage is not None and whole.usage.completion_tokens == 20
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 20
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens > 0


def test_chat_completion_streamed_and_not(env: Env) -> None:
    client = env.gateway.client()
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    whole = client.chat.completions.create(
        model="default", messages=messages, max_tokens=12, temperature=0.7, seed=3
    )
    stream = client.chat.completions.create(
        model="default", messages=messages, max_tokens=12, temperature=0.7, seed=3, stream=True
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert whole.choices[0].message.role == "assistant"
    assert streamed == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert whole.choices[0].finish_reason in ("stop", "length")
    tokenizer = PRESETS["tiny-random"].tokenizer()
    assert whole.usage is not None
    assert whole.usage.prompt_tokens == len(tokenizer.encode(render_chat(tokenizer, messages)))


def test_models_routing_and_chat_without_a_template(env: Env) -> None:
    client = env.gateway.client()
    cards = {m.id: m for m in client.models.list().data}
    assert set(cards) == {"default", "plain"}
    plain = worker_info(env.r, "gw-plain")
    assert cards["plain"].model_extra is not None
    assert cards["plain"].model_extra["max_job_tokens"] == plain["max_job_tokens"]

    with pytest.raises(openai.NotFoundError) as missing:
        client.completions.create(model="nope", prompt="hi", max_tokens=2)
    assert missing.value.code == "model_not_found"

    served = client.completions.create(model="plain", prompt="w5 w6 w7", max_tokens=4, seed=1)
    assert served.usage is not None and served.usage.prompt_tokens == 3

    with pytest.raises(openai.BadRequestError) as no_template:
        client.chat.completions.create(
            model="plain", messages=[{"role": "user", "content": "w5"}], max_tokens=4
        )
    assert no_template.value.code == "rejected_invalid"
    assert "no chat template" in no_template.value.message


def test_jobs_no_worker_could_hold_are_400(env: Env) -> None:
    client = env.gateway.client()
    capacity = worker_info(env.r, "gw-plain")["max_job_tokens"]
    assert isinstance(capacity, int)
    # max_tokens alone is too big for every live worker of the model: the gateway says so
    with pytest.raises(openai.BadRequestError) as too_many:
        client.completions.create(model="plain", prompt="w5", max_tokens=capacity)
    assert too_many.value.code == "rejected_kv_budget"
    assert f"{capacity:,}" in too_many.value.message
    # a prompt that pushes it over: the worker refuses, the gateway turns it into a 400
    long_prompt = " ".join(f"w{3 + i % 200}" for i in range(capacity))
    with pytest.raises(openai.BadRequestError) as too_long:
        client.completions.create(model="plain", prompt=long_prompt, max_tokens=8)
    assert too_long.value.code == "rejected_kv_budget"
    # token ids are counted before submit (by the producer): refused without a worker's help
    with pytest.raises(openai.BadRequestError) as too_many_ids:
        client.completions.create(model="plain", prompt=[5] * capacity, max_tokens=8)
    assert too_many_ids.value.code == "rejected_kv_budget"
    # beyond the model's context length (2048): the worker's rejected_invalid, as a 400
    with pytest.raises(openai.BadRequestError) as context:
        client.completions.create(model="default", prompt="hi", max_tokens=4000)
    assert context.value.code == "rejected_invalid"
    assert "context length" in context.value.message


# ---- raw HTTP: limits and malformed bodies --------------------------------------------


def test_limits_and_bad_bodies_are_400_naming_the_problem(env: Env) -> None:
    url = f"{env.gateway.url}/v1/completions"
    cases = [
        ({"model": "default", "prompt": "hi", "max_tokens": 8193}, "max_tokens", "MAX_NEW_TOKENS"),
        (
            {"model": "default", "prompt": "x" * (MAX_PROMPT_CHARS + 1)},
            "prompt",
            "MAX_PROMPT_CHARS",
        ),
        ({"model": "default", "prompt": "hi", "n": 17}, "n", "MAX_N=16"),  # test_gateway_n
        ({"model": "default", "prompt": "hi", "temperature": "hot"}, "temperature", "valid number"),
        ({"model": "default", "prompt": "hi", "frobnicate": 1}, "frobnicate", "not permitted"),
        ({"model": "default"}, "prompt", "required"),
    ]
    with httpx.Client(timeout=30) as http:
        for body, param, words in cases:
            reply = http.post(url, json=body)
            assert reply.status_code == 400, (body, reply.text)
            error = reply.json()["error"]
            assert error["param"] == param, error
            assert words in error["message"], error
            assert error["type"] == "invalid_request_error"
        reply = http.post(url, content=b'{"model": "default", "prompt": ', headers={})
        assert reply.status_code == 400
        assert reply.json()["error"]["code"] == "invalid_json"
        assert "JSON" in reply.json()["error"]["message"]


def test_client_disconnect_cancels_the_job_and_frees_the_kv(env: Env) -> None:
    body = {
        "model": "default",
        "prompt": "Tell me everything.",
        "max_tokens": 2000,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    url = f"{env.gateway.url}/v1/completions"
    with httpx.Client(timeout=30) as http, http.stream("POST", url, json=body) as reply:
        assert reply.status_code == 200
        job_id = reply.headers["x-tokenfleet-job-id"]
        data = 0
        for line in reply.iter_lines():
            data += line.startswith("data: {")
            if data == 3:
                break
    # the connection is closed: the gateway cancels, the worker stops within a tick

    def finished_cancelled() -> bool:
        return env.r.hget(KEYS.job(job_id), "finish_reason") == b"cancelled"

    wait_for(finished_cancelled, 30, "the job to finish as cancelled")

    def kv_free() -> bool:
        info = worker_info(env.r, "gw-main")
        return info["active"] == 0 and info["kv_used_bytes"] == 0

    wait_for(kv_free, 30, "gw-main to report no active session and no KV in use")
    assert Producer(env.r).handle(job_id).status().fields["finish_reason"] == "cancelled"
    counted = 'tokenfleet_gateway_client_cancellations_total{model="default"} 1.0'
    wait_for(lambda: counted in metrics_of(env.gateway), 30, "the cancellation to be counted")


def test_job_timeout_ends_as_length_with_the_fleet_reason(
    env: Env, redis_server: RedisServer
) -> None:
    gateway = ServedGateway(GatewayConfig(redis_url=redis_server.url, job_timeout_s=0.001))
    try:
        reply = httpx.post(
            f"{gateway.url}/v1/completions",
            json={"model": "default", "prompt": "hi", "max_tokens": 8},
            timeout=30,
        )
    finally:
        gateway.stop()
    assert reply.status_code == 200, reply.text
    choice = reply.json()["choices"][0]
    assert choice["finish_reason"] == "length"
    assert choice["fleet_finish_reason"] == "deadline"


# ---- backpressure and auth (a second fleet prefix with no workers) ---------------------


def test_queue_full_is_429_and_api_keys_are_checked(env: Env, redis_server: RedisServer) -> None:
    keys = Keys("gw-empty:")
    producer = Producer(env.r, keys=keys)
    producer.set_queue_cap(2)
    producer.submit(prompt="occupying one slot", max_new_tokens=4, job_id="direct")
    config = GatewayConfig(
        redis_url=redis_server.url, prefix=keys.prefix, api_keys=("k-one", "k-two"), retry_after_s=3
    )
    gateway = ServedGateway(config)
    auth = {"Authorization": "Bearer k-one"}
    url = f"{gateway.url}/v1/completions"
    try:
        with pytest.raises(openai.AuthenticationError):
            gateway.client("wrong").models.list()
        with httpx.Client(timeout=30) as http:
            missing = http.get(f"{gateway.url}/v1/models")
            assert missing.status_code == 401
            assert missing.json()["error"]["code"] == "invalid_api_key"
            assert http.get(f"{gateway.url}/health").status_code == 200  # health needs no key
        assert gateway.client("k-two").models.list().data == []  # no live worker here

        # no live workers at all: any model queues, as with the producer. A client that
        # gives up before the first token has its queued job cancelled.
        def abandoned() -> list[str]:
            queued = [f[b"job_id"].decode() for _, f in env.r.xrange(keys.jobs())]
            return [job_id for job_id in queued if job_id != "direct"]

        body = json.dumps({"model": "default", "prompt": "x"}).encode()
        head = "POST /v1/completions HTTP/1.1\r\nHost: gw\r\nAuthorization: Bearer k-one\r\n"
        head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        with socket.create_connection(("127.0.0.1", gateway.port)) as raw:
            raw.sendall(head.encode() + body)
            wait_for(lambda: len(abandoned()) == 1, 30, "the request's job to be queued")
        # the connection is closed, no token was ever generated
        wait_for(lambda: env.r.exists(keys.cancel(abandoned()[0])), 30, "its cancel flag")

        # the stream now holds its cap of 2
        with httpx.Client(timeout=30) as http:
            full = http.post(url, json={"model": "default", "prompt": "one more"}, headers=auth)
            assert full.status_code == 429
            assert full.headers["retry-after"] == "3"
            assert full.json()["error"]["code"] == "queue_full"
            assert "cap 2" in full.json()["error"]["message"]
        counted = [
            'tokenfleet_gateway_queue_full_rejections_total{model="default"} 1.0',
            'tokenfleet_gateway_client_cancellations_total{model="default"} 1.0',
            'route="/v1/completions",status="429"',
            'route="/v1/completions",status="499"',
            'route="/v1/models",status="401"',
        ]
        wait_for(
            lambda: all(line in metrics_of(gateway) for line in counted), 30, f"metrics {counted}"
        )
    finally:
        gateway.stop()
    assert producer.depth() == 2  # nothing was added past the cap


def test_health_and_metrics(env: Env) -> None:
    client = env.gateway.client()
    client.completions.create(model="default", prompt="count me", max_tokens=3, stream=False)
    list(client.completions.create(model="default", prompt="and me", max_tokens=3, stream=True))
    with httpx.Client(timeout=30) as http:
        health = http.get(f"{env.gateway.url}/health").json()
        metrics = http.get(f"{env.gateway.url}/metrics").text
    assert health["redis"] is True
    assert health["live_workers"] == 2
    assert health["models"] == ["default", "plain"]
    assert 'tokenfleet_gateway_requests_total{route="/v1/completions",status="200"}' in metrics
    assert "tokenfleet_gateway_time_to_first_token_seconds_count" in metrics
    streamed = [
        line
        for line in metrics.splitlines()
        if line.startswith('tokenfleet_gateway_streamed_tokens_total{model="default"}')
    ]
    assert streamed and float(streamed[0].split()[-1]) >= 1


# ---- the command line -----------------------------------------------------------------


def test_gateway_command_refuses_a_public_address_without_keys() -> None:
    import typer
    from typer.testing import CliRunner

    from tokenfleet.cli.gateway import gateway, is_loopback

    app = typer.Typer()
    app.command()(gateway)
    refused = CliRunner().invoke(app, ["--host", "0.0.0.0"], env={"TOKENFLEET_API_KEYS": ""})
    assert refused.exit_code == 2
    assert "without API keys" in refused.output
    assert all(is_loopback(h) for h in ("127.0.0.1", "localhost", "::1", "127.0.0.2"))
    assert not any(is_loopback(h) for h in ("0.0.0.0", "::", "10.0.0.1", "gateway.internal"))
    entries = ("a", " b ", "c", " a", "", "d")  # stripped, empty ones dropped, repeats once
    assert GatewayConfig(api_keys=entries).api_keys == ("a", "b", "c", "d")


def test_stop_strings_end_the_text_before_them(env: Env) -> None:
    client = env.gateway.client()
    args = dict(model="default", prompt="Stop here:", max_tokens=24, temperature=0.0)
    full = client.completions.create(**args, extra_body={"ignore_eos": True}).choices[0].text
    stop = full[8:10]
    cut = client.completions.create(**args, stop=[stop], extra_body={"ignore_eos": True})
    assert cut.choices[0].text == full[: full.index(stop)]
    assert cut.choices[0].finish_reason == "stop"


def test_response_format_json_schema_and_guided_regex_through_the_openai_client(
    env: Env,
) -> None:
    """Structured output end to end: the official client's `response_format` (json_schema,
    strict) and the `guided_regex` extension; the tiny random model's free output is
    noise, so valid JSON here is the grammar's doing."""
    import jsonschema

    schema = {
        "type": "object",
        "properties": {
            "pick": {"enum": ["a", "b"]},
            "n": {"type": "integer", "minimum": 1, "maximum": 9},
        },
        "required": ["pick", "n"],
        "additionalProperties": False,
    }
    client = env.gateway.client()
    for seed in range(3):
        reply = client.chat.completions.create(
            model="default",
            messages=[{"role": "user", "content": f"give me JSON {seed}"}],
            max_tokens=100,
            temperature=1.0,
            seed=seed,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "pick", "schema": schema, "strict": True},
            },
        )
        assert reply.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(reply.choices[0].message.content or ""), schema)
    regex = client.completions.create(
        model="default",
        prompt="x",
        max_tokens=20,
        temperature=1.0,
        seed=1,
        extra_body={"guided_regex": "(yes|no)-[0-9]{3}"},
    )
    assert re.fullmatch("(yes|no)-[0-9]{3}", regex.choices[0].text)
    with pytest.raises(openai.BadRequestError, match="unclosed group") as refused:
        client.completions.create(
            model="default", prompt="x", max_tokens=5, extra_body={"guided_regex": "("}
        )
    # refused by the gateway before submit, naming the parameter
    assert (refused.value.code, refused.value.param) == ("invalid_value", "guided_regex")


# ---- structured output the fleet cannot honour ------------------------------------------


def schema_format(schema: dict[str, object]) -> dict[str, object]:
    return {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}


def test_a_schema_no_output_can_satisfy_is_400_before_any_token(env: Env) -> None:
    """The client's schema, not a server failure: refused at the gateway, naming
    response_format and the problem, before a job exists (a schema whose every instance
    nests another was a 500 postprocess_error after the job started; a $ref to itself a
    200 with empty, non-JSON content; a schema too deep for the library a worker's
    rejection naming a column in the library's own text)."""
    from tokenfleet.grammar import MAX_SCHEMA_DEPTH

    deep: dict[str, object] = {"type": "string"}
    for _ in range(MAX_SCHEMA_DEPTH // 2):  # two levels each: 125 in all
        deep = {"type": "object", "properties": {"a": deep}, "required": ["a"]}
    cases = [
        (
            {"type": "object", "properties": {"x": {"$ref": "#"}}, "required": ["x"]},
            "no output the grammar library can finish",
        ),
        ({"$ref": "#"}, "allows no output at all"),
        (
            deep,
            f"nests 125 levels deep (objects and arrays inside each other); structured "
            f"output reads at most MAX_SCHEMA_DEPTH={MAX_SCHEMA_DEPTH}",
        ),
    ]
    url = f"{env.gateway.url}/v1/chat/completions"
    with httpx.Client(timeout=30) as http:
        for schema, words in cases:
            for stream in (False, True):
                body = {
                    "model": "default",
                    "messages": [{"role": "user", "content": "json please"}],
                    "max_tokens": 50,
                    "stream": stream,
                    "response_format": schema_format(schema),
                }
                reply = http.post(url, json=body)
                assert reply.status_code == 400, reply.text
                assert "x-tokenfleet-job-id" not in reply.headers  # never submitted
                error = reply.json()["error"]
                assert error["type"] == "invalid_request_error"
                assert (error["param"], error["code"]) == ("response_format", "invalid_value")
                assert words in error["message"], error["message"]


def test_a_body_nested_past_the_parser_limit_is_named_as_such(env: Env) -> None:
    """Valid JSON nested deeper than the JSON parser reads is a 400 naming that limit
    (it was `invalid_json`, "the body is not valid JSON"), however deep, and the gateway
    answers the next request as before."""
    from tokenfleet.openai.errors import MAX_BODY_DEPTH

    schema: dict[str, object] = {"type": "string"}
    for _ in range(MAX_BODY_DEPTH):
        schema = {"type": "object", "properties": {"a": schema}}
    deep = {
        "model": "default",
        "prompt": "x",
        "response_format": schema_format(schema),
    }
    url = f"{env.gateway.url}/v1/completions"
    with httpx.Client(timeout=30) as http:
        bodies = [json.dumps(deep).encode(), b'{"model": "default", "prompt": ' + b"[" * 1_000_000]
        for content in bodies:
            reply = http.post(url, content=content)
            assert reply.status_code == 400, reply.text
            error = reply.json()["error"]
            assert error["code"] == "body_too_deep", error
            assert f"nests deeper than {MAX_BODY_DEPTH} levels" in error["message"]
            assert "not valid JSON" not in error["message"]
        assert http.get(f"{env.gateway.url}/health").json()["status"] == "ok"
        fine = http.post(url, json={"model": "default", "prompt": "x", "max_tokens": 2})
        assert fine.status_code == 200, fine.text


def test_structured_output_that_ends_outside_its_grammar_is_never_stop(env: Env) -> None:
    """A stop string inside the structure, and a schema the library gives up on mid-way
    (a free string first, so nothing can tell up front), end as 400s with a named code —
    non-streamed, and as the error event after the tokens when streamed — never as
    finish_reason `stop` on text that is not the schema's (they were: a 200 `stop` with
    `{"`, and a 500 postprocess_error)."""
    loop = {
        "type": "object",
        "properties": {"a": {"type": "string", "maxLength": 2}, "x": {"$ref": "#/$defs/l"}},
        "required": ["a", "x"],
        "$defs": {
            "l": {"type": "object", "properties": {"y": {"$ref": "#/$defs/l"}}, "required": ["y"]}
        },
    }
    picked = {"type": "object", "properties": {"pick": {"enum": ["a", "b"]}}, "required": ["pick"]}
    cases = [
        ({"response_format": schema_format(picked), "stop": ["pick"]}, "grammar_unsatisfied"),
        ({"response_format": schema_format(loop), "seed": 3}, "grammar_failed"),
    ]
    url = f"{env.gateway.url}/v1/chat/completions"
    with httpx.Client(timeout=60) as http:
        for extra, code in cases:
            body = {
                "model": "default",
                "messages": [{"role": "user", "content": "json please"}],
                "max_tokens": 60,
                "temperature": 1.0,
                **extra,
            }
            plain = http.post(url, json=body)
            assert plain.status_code == 400, plain.text
            error = plain.json()["error"]
            assert (error["type"], error["code"]) == ("invalid_request_error", code), error
            assert "structured-output constraint" in error["message"]
            with http.stream("POST", url, json={**body, "stream": True}) as reply:
                lines = [line for line in reply.iter_lines() if line.startswith("data: ")]
            assert reply.status_code == 200
            assert lines[-1] == "data: [DONE]"
            chunks = [json.loads(line[6:]) for line in lines[:-1]]
            assert chunks[-1]["error"]["code"] == code, chunks[-1]
            content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks[:-1])
            assert content.startswith('{"'), content  # the tokens came, then the error
            finishes = [c["choices"][0].get("finish_reason") for c in chunks[:-1]]
            assert not any(finishes), finishes
