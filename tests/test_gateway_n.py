"""Several choices in one request (issue 23, part 5): `n` > 1 on completions and chat,
several prompts on completions. Each choice is its own fleet job (gateway/fanout.py).

A real redis-server, one tiny-random worker process and uvicorn, driven by the official
`openai` client and raw httpx. The worker's prefix cache shares one prompt's KV between
the choices (worker/scheduler.py): two of three choices find its full blocks cached.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest

from tests.helpers.gateway import GatewayEnv, gateway_env
from tests.helpers.support import KEYS, wait_for
from tokenfleet.gateway.fanout import JOB_IDS_HEADER, choice_seed, usage_of_choices
from tokenfleet.openai.models import MAX_CHOICES, MAX_N
from tokenfleet.producer import Producer
from tokenfleet.protocol import FinishEvent, Usage
from tokenfleet.reasons import FinishReason

BLOCK = 16  # the worker's KV block (EngineConfig's default)
PROMPT_IDS = [(7 * k) % 200 + 3 for k in range(4 * BLOCK + 5)]  # 4 full blocks and 5 tokens

Env = GatewayEnv
env = gateway_env([("gwn-main", ["--max-waiting", "8"])])


def job_ids(headers: httpx.Headers) -> list[str]:
    return headers[JOB_IDS_HEADER].split(",")


def sse(lines: list[str]) -> list[Any]:
    """A stream's data lines: each chunk as JSON, and "[DONE]" as itself."""
    out: list[Any] = []
    for line in lines:
        if line.startswith("data: "):
            data = line.removeprefix("data: ")
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def test_n_3_is_three_choices_and_the_prompt_is_prefilled_once(env: Env) -> None:
    client = env.gateway.client()
    raw = client.completions.with_raw_response.create(
        model="default",
        prompt=PROMPT_IDS,
        n=3,
        max_tokens=4,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    body = raw.parse()
    assert [c.index for c in body.choices] == [0, 1, 2]
    assert all(c.finish_reason == "length" for c in body.choices)
    assert len({c.text for c in body.choices}) == 1  # greedy: the same text three times
    ids = job_ids(raw.headers)
    assert len(set(ids)) == 3 and raw.headers["x-tokenfleet-job-id"] == ids[0]
    assert body.id == f"cmpl-{ids[0]}"
    # usage: the prompt counted once, every choice's tokens
    assert body.usage is not None
    assert body.usage.prompt_tokens == len(PROMPT_IDS)
    assert body.usage.completion_tokens == 3 * 4
    assert body.usage.total_tokens == len(PROMPT_IDS) + 12
    # each choice is a job of its own; one computed the prompt, the two others found its
    # 4 full blocks cached (the last, partial block is each one's own)
    results = [Producer(env.r).handle(job_id).result(timeout=30) for job_id in ids]
    assert sorted(r.usage.cached_tokens for r in results) == [0, 4 * BLOCK, 4 * BLOCK]
    # the request's cached_tokens: what the prompt cost once (the least of its choices')
    details = body.usage.prompt_tokens_details
    assert details is not None and details.cached_tokens == 0


def test_chat_n_3_numbers_its_choices(env: Env) -> None:
    client = env.gateway.client()
    messages = [{"role": "user", "content": "three answers, please"}]
    one = client.chat.completions.create(
        model="default", messages=messages, max_tokens=3, temperature=0
    )
    three = client.chat.completions.create(
        model="default", messages=messages, max_tokens=3, temperature=0, n=3
    )
    assert [c.index for c in three.choices] == [0, 1, 2]
    assert all(c.message.content == one.choices[0].message.content for c in three.choices)
    assert three.usage is not None and one.usage is not None
    assert three.usage.prompt_tokens == one.usage.prompt_tokens  # once, not three times
    assert three.usage.completion_tokens == 3 * one.usage.completion_tokens


def test_each_seeded_choice_equals_a_single_request_with_its_derived_seed(env: Env) -> None:
    client = env.gateway.client()
    args: dict[str, Any] = dict(
        model="default", prompt="Once upon a time", max_tokens=12, temperature=1.0
    )
    extra = {"ignore_eos": True}
    many = client.completions.create(**args, n=3, seed=41, extra_body=extra)
    singles = [
        client.completions.create(**args, seed=choice_seed(41, i), extra_body=extra)
        for i in range(3)
    ]
    assert [c.text for c in many.choices] == [s.choices[0].text for s in singles]
    assert choice_seed(41, 0) == 41  # choice 0 is the plain request with the same seed
    assert len({c.text for c in many.choices}) > 1  # the derived seeds differ
    assert choice_seed(2**63 - 1, 1) == 0  # wrapping inside the seed's range


def test_several_prompts_give_their_choices_in_openais_order(env: Env) -> None:
    client = env.gateway.client()
    prompts = ["The sea", "A mountain", "Some rain"]
    args: dict[str, Any] = dict(model="default", max_tokens=6, temperature=1.0)
    extra = {"ignore_eos": True}
    many = client.completions.create(**args, prompt=prompts, n=2, seed=7, extra_body=extra)
    assert [c.index for c in many.choices] == list(range(6))
    prompt_tokens = 0
    for p, prompt in enumerate(prompts):
        for i in range(2):
            single = client.completions.create(
                **args, prompt=prompt, seed=choice_seed(7, i), extra_body=extra
            )
            assert many.choices[p * 2 + i].text == single.choices[0].text, (p, i)
            assert single.usage is not None
            prompt_tokens += single.usage.prompt_tokens if i == 0 else 0
    assert many.usage is not None and many.usage.completion_tokens == 6 * 6
    assert many.usage.prompt_tokens == prompt_tokens  # each prompt once
    # token-id prompts too: each once in prompt_tokens
    ids = client.completions.create(**args, prompt=[[5, 6, 7], [8, 9]], extra_body=extra)
    assert [c.index for c in ids.choices] == [0, 1]
    assert ids.usage is not None and ids.usage.prompt_tokens == 3 + 2


def test_a_streamed_n_2_interleaves_both_choices_then_ends_once(env: Env) -> None:
    body = {
        "model": "default",
        "messages": [{"role": "user", "content": "stream two"}],
        "max_tokens": 8,
        "temperature": 1.0,
        "seed": 5,
        "n": 2,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    url = f"{env.gateway.url}/v1/chat/completions"
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", url, json=body) as reply:
            assert reply.status_code == 200
            events = sse(list(reply.iter_lines()))
        whole = http.post(url, json={**body, "stream": False}).json()
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    usage = events[-2]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 16
    chunks = events[:-2]
    assert len({c["id"] for c in chunks}) == 1
    indices = [c["choices"][0]["index"] for c in chunks]
    assert set(indices) == {0, 1}
    texts = {0: "", 1: ""}
    finished: dict[int, str] = {}
    for chunk in chunks:
        choice = chunk["choices"][0]
        assert choice["index"] not in finished  # nothing of a choice after its finish chunk
        texts[choice["index"]] += choice["delta"].get("content") or ""
        if choice["finish_reason"] is not None:
            finished[choice["index"]] = choice["finish_reason"]
    assert finished == {0: "length", 1: "length"}
    # the same seed, not streamed: the same two texts
    assert [c["message"]["content"] for c in whole["choices"]] == [texts[0], texts[1]]
    # and the official client reads the stream by index
    client = env.gateway.client()
    asked = {k: v for k, v in body.items() if k != "ignore_eos"}
    streamed = client.chat.completions.create(**asked, extra_body={"ignore_eos": True})
    got = {0: "", 1: ""}
    for chunk in streamed:
        for choice in chunk.choices:
            got[choice.index] += choice.delta.content or ""
    assert got == texts


@pytest.mark.parametrize(
    ("extra", "param", "words"),
    [
        ({"n": MAX_N + 1}, "n", f"MAX_N={MAX_N}"),
        ({"n": 0}, "n", "give 1 to"),
        ({"prompt": ["a"] * 17}, "prompt", "MAX_PROMPTS"),
        ({"prompt": ["a"] * 9, "n": 4}, "prompt", f"MAX_CHOICES={MAX_CHOICES}"),
        ({"prompt": ["a", ""]}, "prompt", "prompt 1 is empty"),
    ],
)
def test_too_many_choices_are_a_400_naming_the_field(
    env: Env, extra: dict[str, Any], param: str, words: str
) -> None:
    url = f"{env.gateway.url}/v1/completions"
    reply = httpx.post(url, json={"model": "default", "prompt": "hi", **extra}, timeout=30)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and words in error["message"], error
    client = env.gateway.client()
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(
            model="default", messages=[{"role": "user", "content": "x"}], n=MAX_N + 1
        )


def test_a_failed_choice_fails_the_request_and_cancels_the_others(env: Env) -> None:
    """Choice 0's prompt has a token id outside tiny-random's vocabulary: the worker
    rejects it; the request is that rejection's 400, and choice 1 is cancelled."""
    body = {
        "model": "default",
        "prompt": [[5000, 5001], PROMPT_IDS],
        "max_tokens": 300,
        "temperature": 0,
        "ignore_eos": True,
    }
    reply = httpx.post(f"{env.gateway.url}/v1/completions", json=body, timeout=60)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["code"] == "rejected_invalid"
    bad, good = job_ids(reply.headers)

    def ended(job_id: str) -> bytes | None:
        value = env.r.hget(KEYS.job(job_id), "finish_reason")
        return value if isinstance(value, bytes) else None

    wait_for(lambda: ended(good) == b"cancelled", 30, "the other choice to be cancelled")
    assert ended(bad) == b"rejected"


def test_a_client_hanging_up_cancels_every_choice(env: Env) -> None:
    body = {
        "model": "default",
        "prompt": "Tell me everything.",
        "max_tokens": 2000,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "n": 2,
    }
    url = f"{env.gateway.url}/v1/completions"
    with httpx.Client(timeout=30) as http, http.stream("POST", url, json=body) as reply:
        assert reply.status_code == 200
        ids = job_ids(reply.headers)
        data = 0
        for line in reply.iter_lines():
            data += line.startswith("data: {")
            if data == 4:
                break

    def all_cancelled() -> bool:
        return all(env.r.hget(KEYS.job(i), "finish_reason") == b"cancelled" for i in ids)

    wait_for(all_cancelled, 30, "both choices to finish as cancelled")


def test_usage_counts_each_prompt_once_and_its_least_cached() -> None:
    """Pure: two prompts, n=2 each (choices by index: prompt 0's two, then prompt 1's)."""

    def finish(prompt: int, completion: int, cached: int) -> FinishEvent:
        usage = Usage(prompt_tokens=prompt, completion_tokens=completion, cached_tokens=cached)
        return FinishEvent(job_id="j", reason=FinishReason.LENGTH, usage=usage)

    ends = [finish(40, 5, 0), finish(40, 6, 32), finish(9, 7, 0), finish(9, 8, 0)]
    usage = usage_of_choices(ends, 2)
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (49, 26, 75)
    assert usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens == 0
    shared = usage_of_choices([finish(40, 5, 32), finish(40, 5, 16)], 2)
    assert shared.prompt_tokens_details is not None
    assert shared.prompt_tokens_details.cached_tokens == 16
