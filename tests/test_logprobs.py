"""Logprobs: the raw model logits' log-softmax (checked against transformers on the same
weights), computed only for the sessions that ask and never changing a token, carried in
token events and results, and rendered OpenAI's way through the gateway."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest
import torch
from pydantic import ValidationError

from tests.helpers.gateway import GatewayEnv, gateway_env
from tests.helpers.models import make_hf_llama, reference_logits, save_hf_llama
from tests.test_engine import Run, run_jobs
from tokenfleet.model import LoadedModel, load_model
from tokenfleet.openai.models import ChatCompletionRequest, CompletionRequest
from tokenfleet.openai.render import Renderer, chat_logprobs, completion_logprobs
from tokenfleet.protocol import (
    FinishEvent,
    GenerationRequest,
    JobResult,
    SamplingParams,
    TokenEvent,
    TokenLogprob,
    decode_event,
    decode_result,
    encode,
)
from tokenfleet.reasons import FinishReason
from tokenfleet.worker.engine import Engine, EngineConfig

PROMPT = [1, 17, 93, 400, 5, 77, 250]


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    return load_model("tiny-random")


def _job(job_id: str, n: int = 10, /, **sampling: object) -> GenerationRequest:
    return GenerationRequest(
        job_id=job_id,
        prompt="logprobs, please",
        max_new_tokens=n,
        ignore_eos=True,
        sampling=SamplingParams.model_validate(sampling),
    )


def test_logprobs_equal_transformers_log_softmax_on_the_same_weights(tmp_path: Path) -> None:
    hf = make_hf_llama(seed=3)
    loaded = load_model(str(save_hf_llama(hf, tmp_path)), dtype="float32", device="cpu")
    job = GenerationRequest(
        job_id="lp",
        prompt_ids=PROMPT,
        max_new_tokens=6,
        ignore_eos=True,
        sampling=SamplingParams(temperature=0.0, logprobs=5),
    )
    run = run_jobs(loaded, [job])
    events = [e for step in run.steps for e in step.tokens]
    assert len(events) == 6
    for i, event in enumerate(events):
        context = PROMPT + [e.token_id for e in events[:i]]
        want = torch.log_softmax(reference_logits(hf, context)[-1], dim=-1)
        assert event.logprobs is not None
        assert event.token_id == int(want.argmax())  # greedy
        assert abs(event.logprobs.logprob - float(want[event.token_id])) < 1e-4
        values, ids = want.topk(5)
        assert [t for t, _, _ in event.logprobs.top] == ids.tolist()
        got = torch.tensor([lp for _, lp, _ in event.logprobs.top])
        torch.testing.assert_close(got, values, rtol=0, atol=1e-4)
        assert event.logprobs.top[0][1] == event.logprobs.logprob  # greedy: the sampled is top-1


def test_asking_for_logprobs_changes_no_token_of_any_session_in_the_batch(
    tiny: LoadedModel,
) -> None:
    samplings: list[dict[str, object]] = [{}, {"temperature": 0.9, "seed": 11}]
    for sampling, k in zip(samplings, (5, 0), strict=True):
        quiet, asking = _job("quiet", **sampling), _job("asking", **sampling, logprobs=k)
        run = run_jobs(tiny, [quiet, asking])
        assert run.tokens["quiet"] == run.tokens["asking"]
        assert run.tokens["quiet"] == run_jobs(tiny, [quiet]).tokens["quiet"]
        events = [e for step in run.steps for e in step.tokens]
        assert all(e.logprobs is None for e in events if e.job_id == "quiet")
        mine = [e.logprobs for e in events if e.job_id == "asking"]
        assert all(lp is not None and len(lp.top) == k for lp in mine)
        result = run.finished["asking"].result
        assert result.logprobs == mine and run.finished["quiet"].result.logprobs is None


def test_a_resumed_job_keeps_the_logprobs_its_first_worker_published(tiny: LoadedModel) -> None:
    """A job resumed after 4 tokens (the events another worker published, logprobs
    included) ends with a result whose logprobs are those 4 and its own: the whole
    job's, as if it had run on one worker."""
    whole = run_jobs(tiny, [_job("whole", 10, logprobs=2)]).finished["whole"].result
    assert whole.logprobs is not None and len(whole.logprobs) == 10
    engine = Engine(tiny, EngineConfig(kv_budget_bytes=16 * 2**20))
    resumed = _job("whole", 10, logprobs=2)
    decision = engine.submit(
        resumed, resume_ids=whole.token_ids[:4], resume_logprobs=whole.logprobs[:4]
    )
    assert decision.accepted
    result = Run(engine).drain().finished["whole"].result
    assert result.token_ids == whole.token_ids
    assert result.logprobs is not None and result.logprobs[:4] == whole.logprobs[:4]
    assert [lp.token for lp in result.logprobs] == [lp.token for lp in whole.logprobs]
    # without them (events that carried none), the result says it has no whole list
    engine = Engine(tiny, EngineConfig(kv_budget_bytes=16 * 2**20))
    assert engine.submit(resumed, resume_ids=whole.token_ids[:4]).accepted
    assert Run(engine).drain().finished["whole"].result.logprobs is None


def test_penalties_do_not_change_the_reported_logprobs(tiny: LoadedModel) -> None:
    """Logprobs are the raw model's: a bias that forces a token leaves them as they were."""
    plain = run_jobs(tiny, [_job("p", 1, logprobs=3)]).finished["p"].result
    forced = (
        run_jobs(tiny, [_job("f", 1, logprobs=3, logit_bias={"120": 100.0})]).finished["f"].result
    )
    assert forced.token_ids == [120] and plain.token_ids != [120]
    assert plain.logprobs is not None and forced.logprobs is not None
    assert forced.logprobs[0].top == plain.logprobs[0].top
    assert forced.logprobs[0].token == "x"  # byte 120's text


def test_events_without_logprobs_encode_as_before_and_with_them_round_trip() -> None:
    plain = TokenEvent(job_id="j", index=0, token_id=5, text="a")
    assert b"logprobs" not in encode(plain)
    lp = TokenLogprob(logprob=-0.25, token="a", top=[(5, -0.25, "a"), (6, -2.0, "b")])
    rich = TokenEvent(job_id="j", index=0, token_id=5, text="a", logprobs=lp)
    assert decode_event(encode(rich)) == rich
    result = JobResult(job_id="j", finish_reason=FinishReason.STOP, token_ids=[5], logprobs=[lp])
    assert decode_result(encode(result)) == result
    assert b"logprobs" not in encode(JobResult(job_id="j", finish_reason=FinishReason.STOP))
    assert b"logprobs" not in encode(SamplingParams())


def test_openai_requests_ask_for_logprobs_within_the_limit() -> None:
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    asked = ChatCompletionRequest.model_validate({**chat, "logprobs": True, "top_logprobs": 4})
    assert asked.fleet_fields(8)["sampling"]["logprobs"] == 4
    only = ChatCompletionRequest.model_validate({**chat, "logprobs": True})
    assert only.fleet_fields(8)["sampling"]["logprobs"] == 0
    assert "logprobs" not in ChatCompletionRequest.model_validate(chat).fleet_fields(8)["sampling"]
    for bad in ({"logprobs": True, "top_logprobs": 21}, {"top_logprobs": 2}):
        with pytest.raises(ValidationError, match="top_logprobs"):
            ChatCompletionRequest.model_validate({**chat, **bad})
    completion = CompletionRequest.model_validate({"model": "m", "prompt": "x", "logprobs": 2})
    assert completion.fleet_fields(8)["sampling"]["logprobs"] == 2
    echoed = CompletionRequest.model_validate({"model": "m", "prompt": "x", "echo": True})
    assert "prompt_logprobs" not in echoed.fleet_fields(8)["sampling"]  # echoed by the gateway


def test_renderer_writes_openais_shapes() -> None:
    entries = [
        TokenLogprob(logprob=-0.5, token="é", top=[(7, -0.5, "é"), (8, -1.5, " b")]),
        TokenLogprob(logprob=-3.0, token="c", top=[(9, -0.1, "d"), (10, -2.0, "e")]),
    ]
    chat = chat_logprobs(entries).model_dump()
    assert chat["content"][0] == {
        "token": "é",
        "logprob": -0.5,
        "bytes": [0xC3, 0xA9],
        "top_logprobs": [
            {"token": "é", "logprob": -0.5, "bytes": [0xC3, 0xA9]},
            {"token": " b", "logprob": -1.5, "bytes": [32, 98]},
        ],
    }
    legacy = completion_logprobs(entries).model_dump()
    assert legacy == {
        "tokens": ["é", "c"],
        "token_logprobs": [-0.5, -3.0],
        "top_logprobs": [{"é": -0.5, " b": -1.5}, {"d": -0.1, "e": -2.0}],
        "text_offset": [0, 1],
    }
    out = Renderer("completions", "j", "m", 0)
    chunks = [
        out.token(TokenEvent(job_id="j", index=i, token_id=7, text=e.token, logprobs=e))
        for i, e in enumerate(entries)
    ]
    assert b'"text_offset":[1]' in chunks[1]
    finish = FinishEvent(job_id="j", reason=FinishReason.LENGTH)
    body = Renderer("chat", "j", "m", 0).body("éc", finish, entries).model_dump()
    assert body["choices"][0]["logprobs"]["content"][1]["token"] == "c"


# ---- through the gateway, with the official client ----------------------------------------

env = gateway_env([("lp-main", [])])


def test_chat_logprobs_through_the_openai_client(env: GatewayEnv) -> None:
    client = env.gateway.client()
    args = dict(
        model="default",
        messages=[{"role": "user", "content": "count"}],
        max_tokens=8,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        extra_body={"ignore_eos": True},
    )
    whole = client.chat.completions.create(**args)  # type: ignore[call-overload]
    content = whole.choices[0].logprobs.content
    assert len(content) == 8
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.logprob == entry.top_logprobs[0].logprob  # greedy
        assert entry.bytes == list(entry.token.encode())
    streamed = [
        entry
        for chunk in client.chat.completions.create(**args, stream=True)  # type: ignore[call-overload]
        if chunk.choices and chunk.choices[0].logprobs is not None
        for entry in chunk.choices[0].logprobs.content
    ]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]
    assert all(len(e.top_logprobs) == 3 for e in streamed)
    plain = client.chat.completions.create(**{**args, "logprobs": None, "top_logprobs": None})  # type: ignore[call-overload]
    assert plain.choices[0].logprobs is None
    assert plain.choices[0].message.content == whole.choices[0].message.content


def test_completion_logprobs_and_the_limit_through_the_openai_client(env: GatewayEnv) -> None:
    client = env.gateway.client()
    done = client.completions.create(
        model="default", prompt="abc", max_tokens=5, temperature=0, logprobs=2
    )
    lp = done.choices[0].logprobs
    assert lp is not None and len(lp.tokens or []) == 5
    assert all(len(top) <= 2 for top in lp.top_logprobs or [])
    assert lp.text_offset == [sum(len(t) for t in (lp.tokens or [])[:i]) for i in range(5)]
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        client.chat.completions.create(
            model="default",
            messages=[{"role": "user", "content": "x"}],
            logprobs=True,
            top_logprobs=21,
        )
