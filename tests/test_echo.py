"""Completions' echo: the prompt's own logprobs (each prompt token's, given the tokens
before it) computed by the prefill from every prompt position's logits, checked against
transformers on the same weights; `max_tokens: 0` (prefill only); and the echoed text
and logprobs through the gateway, streamed and not, and in Batch API output lines."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest
import torch

from tests.helpers.gateway import GatewayEnv, gateway_env
from tests.helpers.models import make_hf_llama, reference_logits, save_hf_llama
from tests.test_engine import run_jobs
from tokenfleet.batch.format import BatchLine, result_line
from tokenfleet.model import LoadedModel, load_model
from tokenfleet.openai.models import CompletionRequest
from tokenfleet.protocol import (
    GenerationRequest,
    JobResult,
    PromptEcho,
    SamplingParams,
    TokenLogprob,
    decode_event,
    decode_result,
    encode,
)
from tokenfleet.reasons import FinishReason
from tokenfleet.worker.engine import Engine, EngineConfig

PROMPT = [1, 17, 93, 200, 5, 77, 250, 9, 10, 11, 230, 12, 13, 14, 15, 16, 17, 18, 19]
MiB = 1024 * 1024


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    return load_model("tiny-random")


def _echo_job(job_id: str, n: int, k: int | None = 3, **more: object) -> GenerationRequest:
    return GenerationRequest(
        job_id=job_id,
        prompt_ids=PROMPT,
        max_new_tokens=n,
        ignore_eos=True,
        sampling=SamplingParams(temperature=0.0, prompt_logprobs=k),
        **more,  # type: ignore[arg-type]
    )


def test_prompt_logprobs_equal_transformers_over_chunked_prefill(tmp_path: Path) -> None:
    hf = make_hf_llama(seed=5)
    loaded = load_model(str(save_hf_llama(hf, tmp_path)), dtype="float32", device="cpu")
    jobs = [_echo_job("echo", 3), _echo_job("only", 0, k=0), _echo_job("plain", 3, k=None)]
    # 5 prompt tokens a tick: every prompt is fed in 4 chunks, some ending mid-block
    run = run_jobs(loaded, jobs, max_prefill_tokens_per_tick=5)
    want = torch.log_softmax(reference_logits(hf, PROMPT), dim=-1)  # [P, vocab]

    echo = run.finished["echo"].result.prompt
    assert echo is not None and len(echo.logprobs) == len(PROMPT) - 1
    for position, entry in enumerate(echo.logprobs, start=1):
        row = want[position - 1]  # the logits before the token give its logprob
        assert abs(entry.logprob - float(row[PROMPT[position]])) < 1e-4
        values, ids = row.topk(3)
        assert [t for t, _, _ in entry.top] == ids.tolist()
        torch.testing.assert_close(
            torch.tensor([lp for _, lp, _ in entry.top]), values, rtol=0, atol=1e-4
        )
    events = [e for step in run.steps for e in step.tokens if e.job_id == "echo"]
    assert events[0].prompt == echo  # streamed with the first token, once
    assert all(e.prompt is None for e in events[1:])
    assert run.finished["echo"].event.prompt is None  # a token event carried it already
    assert run.tokens["echo"] == run.tokens["plain"]  # asking changes no generated token

    only = run.finished["only"]  # max_new_tokens 0: the prefill, no token
    assert only.event.reason == FinishReason.LENGTH and only.result.token_ids == []
    assert only.event.prompt is not None and only.event.prompt == only.result.prompt
    torch.testing.assert_close(  # the same positions in another batch: fp32 noise only
        torch.tensor([e.logprob for e in only.result.prompt.logprobs]),
        torch.tensor([e.logprob for e in echo.logprobs]),
        rtol=0,
        atol=1e-5,
    )
    assert all(e.top == [] for e in only.result.prompt.logprobs)  # k = 0
    assert only.result.usage.prompt_tokens == len(PROMPT)
    assert only.result.usage.completion_tokens == 0
    assert run.finished["plain"].result.prompt is None


def test_an_echo_job_shares_no_cached_prefix_and_its_neighbours_still_do(
    tiny: LoadedModel,
) -> None:
    engine = Engine(tiny, EngineConfig(kv_budget_bytes=16 * MiB))
    for job in (_echo_job("warm", 2, k=None), _echo_job("warm-2", 2, k=None)):
        assert engine.submit(job).accepted
        while engine.has_work:
            engine.step()
    assert engine.submit(_echo_job("echo", 2)).accepted
    finished = []
    while engine.has_work:
        finished += engine.step().finished
    (done,) = finished
    assert done.result.usage.cached_tokens == 0  # every position computed
    assert done.result.prompt is not None
    assert len(done.result.prompt.logprobs) == len(PROMPT) - 1
    assert engine.blocks.stats.hits_tokens > 0  # the second warm job did hit


def test_a_chunk_computed_again_keeps_the_first_logprobs() -> None:
    from tokenfleet.worker.session import Session

    session = Session(
        request=_echo_job("s", 2),
        prompt_ids=PROMPT,
        sampling=None,  # type: ignore[arg-type]
        detok=None,
        stop_ids=frozenset(),
        submitted_at=0.0,
        scratch_bytes=0,
    )
    first = [TokenLogprob(logprob=-1.0 * i) for i in range(1, 6)]
    session.record_prompt(1, first)
    assert session.echo() is None  # not complete yet
    session.record_prompt(1, [TokenLogprob(logprob=-9.0)] * 5)  # preempted, recomputed
    session.record_prompt(6, [TokenLogprob(logprob=-2.0)] * (len(PROMPT) - 6))
    echo = session.echo()
    assert echo is not None and echo.logprobs[:5] == first
    assert len(echo.logprobs) == len(PROMPT) - 1


def test_echo_travels_in_events_and_results_and_is_absent_otherwise() -> None:
    echo = PromptEcho(text="ab", first_token="a", logprobs=[TokenLogprob(logprob=-0.5, token="b")])
    result = JobResult(job_id="j", finish_reason=FinishReason.LENGTH, prompt=echo)
    assert decode_result(encode(result)) == result
    plain = JobResult(job_id="j", finish_reason=FinishReason.LENGTH)
    assert b"\xa6prompt" not in encode(plain)
    from tokenfleet.protocol import TokenEvent

    event = TokenEvent(job_id="j", index=0, token_id=3, prompt=echo)
    assert decode_event(encode(event)) == event
    assert b"\xa6prompt" not in encode(TokenEvent(job_id="j", index=1, token_id=3))


def test_openai_requests_map_echo_onto_prompt_logprobs() -> None:
    def job_k(**body: object) -> int | None:
        return CompletionRequest.model_validate({"model": "m", **body}).prompt_logprobs_asked()

    assert job_k(prompt="hi", echo=True, logprobs=2) == 2
    assert job_k(prompt="hi", echo=True) is None  # a text prompt is echoed by the gateway
    assert job_k(prompt=[5, 6], echo=True) == 0  # ids: the worker writes the text
    assert job_k(prompt="hi", logprobs=2) is None
    assert job_k(prompt="hi", echo=True, max_tokens=0) is None
    with pytest.raises(ValueError, match="max_tokens 0"):
        CompletionRequest.model_validate({"model": "m", "prompt": "hi", "max_tokens": 0})


def test_batch_output_lines_echo_the_prompt() -> None:
    body = {"model": "default", "prompt": "ab", "echo": True, "logprobs": 1, "max_tokens": 1}
    line = BatchLine(
        index=0,
        custom_id="c",
        kind="completions",
        body=CompletionRequest.model_validate(body),
    )
    echo = PromptEcho(
        text="ab",
        first_token="a",
        logprobs=[TokenLogprob(logprob=-0.5, token="b", top=[(7, -0.25, "c")])],
    )
    result = JobResult(
        job_id="j",
        text="d",
        token_ids=[9],
        finish_reason=FinishReason.LENGTH,
        logprobs=[TokenLogprob(logprob=-0.1, token="d")],
        prompt=echo,
    )
    out, ok = result_line("batch_x", line, result)
    assert ok
    choice = out["response"]["body"]["choices"][0]
    assert choice["text"] == "abd"
    lp = choice["logprobs"]
    assert lp["tokens"] == ["a", "b", "d"]
    assert lp["token_logprobs"] == [None, -0.5, -0.1]
    assert lp["top_logprobs"] == [None, {"c": -0.25}, {}]
    assert lp["text_offset"] == [0, 1, 2]


# ---- through the gateway, with the official client ----------------------------------------

env = gateway_env([("echo-main", [])])


def test_echo_through_the_openai_client(env: GatewayEnv) -> None:
    client = env.gateway.client()
    prompt = "the quick brown fox"
    scored = client.completions.create(
        model="default", prompt=prompt, max_tokens=0, echo=True, logprobs=2, temperature=0
    )
    choice = scored.choices[0]
    assert choice.text == prompt and choice.finish_reason == "length"
    lp = choice.logprobs
    assert lp is not None and lp.token_logprobs is not None and lp.tokens is not None
    assert lp.token_logprobs[0] is None and all(v is not None for v in lp.token_logprobs[1:])
    assert lp.top_logprobs is not None and lp.top_logprobs[0] is None
    assert len(lp.tokens) == scored.usage.prompt_tokens  # type: ignore[union-attr]
    assert scored.usage.completion_tokens == 0  # type: ignore[union-attr]

    args = dict(model="default", prompt=prompt, max_tokens=4, echo=True, logprobs=1, temperature=0)
    whole = client.completions.create(**args, extra_body={"ignore_eos": True})  # type: ignore[call-overload]
    text = whole.choices[0].text
    assert text.startswith(prompt) and len(whole.choices[0].logprobs.tokens) == len(lp.tokens) + 4
    assert whole.choices[0].logprobs.token_logprobs[: len(lp.tokens)] == lp.token_logprobs
    chunks = list(client.completions.create(**args, stream=True, extra_body={"ignore_eos": True}))  # type: ignore[call-overload]
    streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    assert streamed == text
    tokens = [
        t
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for t in c.choices[0].logprobs.tokens
    ]
    assert tokens == whole.choices[0].logprobs.tokens
    offsets = [
        o
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for o in c.choices[0].logprobs.text_offset
    ]
    assert offsets == whole.choices[0].logprobs.text_offset

    plain = client.completions.create(model="default", prompt=prompt, max_tokens=3, echo=True)
    assert plain.choices[0].text.startswith(prompt) and plain.choices[0].logprobs is None
    ids = client.completions.create(model="default", prompt=[5, 6, 7], max_tokens=0, echo=True)
    assert ids.choices[0].text != "" and ids.choices[0].logprobs is None

    several = client.completions.create(  # lm-eval's loglikelihood requests, batched
        model="default", prompt=["a b", "c d e"], max_tokens=0, echo=True, logprobs=1
    )
    assert [c.text for c in several.choices] == ["a b", "c d e"]
    assert all(c.logprobs.token_logprobs[0] is None for c in several.choices)  # type: ignore[union-attr]

    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model="default", prompt=prompt, max_tokens=0)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.chat.completions.create(
            model="default", messages=[{"role": "user", "content": "x"}], max_tokens=0
        )
