"""Penalties and logit bias: the rules against transformers' processor and OpenAI's formula,
counts rebuilt from a session's tokens, and the tiny model's output under them."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from pydantic import ValidationError
from transformers import RepetitionPenaltyLogitsProcessor

from tests.test_engine import MiB, Run, run_jobs
from tokenfleet.model import LoadedModel, Sampler, SamplingState, load_model
from tokenfleet.model.penalties import Penalties
from tokenfleet.openai.models import ChatCompletionRequest
from tokenfleet.protocol import GenerationRequest, SamplingParams
from tokenfleet.reasons import FinishReason
from tokenfleet.seam import ResolvedSampling
from tokenfleet.worker.engine import Engine, EngineConfig

VOCAB = 300
PROMPT = [5, 9, 9, 17, 250]
OUTPUT = [9, 42, 42, 42, 7, 250, 3]


def _row(seed: int = 0) -> torch.Tensor:
    return torch.randn(VOCAB, generator=torch.Generator().manual_seed(seed)) * 4


def _apply(params: ResolvedSampling, row: torch.Tensor, output: list[int] = OUTPUT) -> torch.Tensor:
    penalties = Penalties.of(params)
    assert penalties is not None
    penalties.observe(PROMPT, output)
    return penalties.apply(row)


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    return load_model("tiny-random")


def test_repetition_penalty_equals_transformers_processor() -> None:
    row = _row()
    for p in (1.3, 0.7):
        got = _apply(ResolvedSampling(repetition_penalty=p), row)
        ids = torch.tensor([PROMPT + OUTPUT])
        want = RepetitionPenaltyLogitsProcessor(p)(ids, row[None].clone())[0]
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_frequency_and_presence_follow_openais_formula_over_generated_tokens_only() -> None:
    row = _row(1)
    got = _apply(ResolvedSampling(frequency_penalty=0.6, presence_penalty=-1.5), row)
    counts = np.bincount(OUTPUT, minlength=VOCAB)  # the prompt's tokens are not counted
    want = row.numpy() - 0.6 * counts - (-1.5) * (counts > 0)
    np.testing.assert_allclose(got.numpy(), want, rtol=0, atol=1e-5)
    assert got[17] == row[17] and got[5] == row[5]  # prompt-only tokens: untouched


def test_all_rules_in_order_repetition_then_counts_then_bias() -> None:
    row = _row(2)
    params = ResolvedSampling(
        repetition_penalty=1.2,
        frequency_penalty=0.5,
        presence_penalty=0.25,
        logit_bias=((42, 3.0), (100, -100.0)),
    )
    got = _apply(params, row)
    x = row.numpy().copy()
    seen = sorted(set(PROMPT + OUTPUT))
    x[seen] = np.where(x[seen] < 0, x[seen] * 1.2, x[seen] / 1.2)
    counts = np.bincount(OUTPUT, minlength=VOCAB)
    x = x - 0.5 * counts - 0.25 * (counts > 0)
    x[42] += 3.0
    x[100] -= 100.0
    np.testing.assert_allclose(got.numpy(), x, rtol=0, atol=1e-5)


def test_counts_caught_up_tick_by_tick_equal_counts_made_at_once() -> None:
    """A state that saw the tokens one tick at a time and one built afterwards (a resumed
    session's) adjust the same logits the same way."""
    params = ResolvedSampling(repetition_penalty=1.5, frequency_penalty=1.0, presence_penalty=0.5)
    stepwise = Penalties.of(params)
    assert stepwise is not None
    output: list[int] = []  # the session's list, appended to as tokens are emitted
    stepwise.observe(PROMPT, output)
    for token in OUTPUT:
        stepwise.apply(_row())
        output.append(token)
    row = _row(3)
    torch.testing.assert_close(stepwise.apply(row), _apply(params, row), rtol=0, atol=0)


def test_sessions_without_penalties_cost_nothing_and_keep_their_rows() -> None:
    assert Penalties.of(ResolvedSampling()) is None
    assert SamplingState.for_params(ResolvedSampling(seed=1)).penalties is None
    logits = torch.stack([_row(4), _row(5)])
    before = logits.clone()
    plain = SamplingState.for_params(ResolvedSampling())
    biased = SamplingState.for_params(ResolvedSampling(logit_bias=((7, 100.0),)))
    assert biased.penalties is not None
    biased.penalties.observe(PROMPT, [])
    tokens = Sampler().sample(logits, [plain, biased])
    assert tokens == [int(before[0].argmax()), 7]
    assert torch.equal(logits, before)  # the raw logits are not written (logprobs read them)


def test_parameters_out_of_range_are_refused() -> None:
    for bad in (
        dict(presence_penalty=2.5),
        dict(frequency_penalty=-2.01),
        dict(repetition_penalty=0.0),
        dict(logit_bias={"5": 100.5}),
        dict(logit_bias={"x": 1.0}),
        dict(logit_bias={str(i): 1.0 for i in range(301)}),
    ):
        with pytest.raises(ValidationError):
            SamplingParams.model_validate(bad)
    with pytest.raises(ValueError, match="repetition_penalty"):
        ResolvedSampling(repetition_penalty=-1.0)
    assert SamplingParams(logit_bias={"9": -1, "3": 2.5}).bias_pairs() == ((3, 2.5), (9, -1.0))


def test_an_openai_request_maps_its_penalties_into_the_job() -> None:
    ask = ChatCompletionRequest.model_validate(
        {
            "model": "m",
            "messages": [{"role": "user", "content": "hi"}],
            "presence_penalty": 0.5,
            "frequency_penalty": 1,
            "repetition_penalty": 1.1,
            "logit_bias": {"42": -100, "7": 5},
        }
    )
    sampling = ask.fleet_fields(8)["sampling"]
    assert sampling["presence_penalty"] == 0.5 and sampling["frequency_penalty"] == 1
    assert sampling["repetition_penalty"] == 1.1
    assert sampling["logit_bias"] == {"42": -100.0, "7": 5.0}
    assert SamplingParams.model_validate(sampling).bias_pairs() == ((7, 5.0), (42, -100.0))
    for field, value in (("presence_penalty", 3), ("logit_bias", {"1": 101})):
        with pytest.raises(ValidationError, match=field):
            ChatCompletionRequest.model_validate(
                {"model": "m", "messages": [{"role": "user", "content": "hi"}], field: value}
            )


# ---- the engine, with the tiny model ------------------------------------------------------


def _job(job_id: str, n: int = 24, **sampling: object) -> GenerationRequest:
    return GenerationRequest(
        job_id=job_id,
        prompt="the same words again and again",
        max_new_tokens=n,
        ignore_eos=True,
        sampling=SamplingParams.model_validate(sampling),
    )


def test_a_strong_frequency_penalty_changes_greedy_output_and_repeats_nothing(
    tiny: LoadedModel,
) -> None:
    run = run_jobs(
        tiny, [_job("plain"), _job("penalized", frequency_penalty=2.0, presence_penalty=2.0)]
    )
    plain, penalized = run.tokens["plain"], run.tokens["penalized"]
    assert len(set(plain)) < len(plain)  # greedy alone repeats itself
    assert penalized != plain
    assert len(set(penalized)) == len(penalized)


def test_logit_bias_of_100_forces_its_token(tiny: LoadedModel) -> None:
    run = run_jobs(tiny, [_job("forced", 8, logit_bias={"120": 100.0})])
    assert run.tokens["forced"] == [120] * 8


def test_a_resumed_penalized_job_continues_with_the_same_tokens(tiny: LoadedModel) -> None:
    for sampling in (
        dict(frequency_penalty=1.5, repetition_penalty=1.3),
        dict(presence_penalty=1.0, temperature=1.0, seed=4, logit_bias={"50": 2.0}),
    ):
        request = _job("r", 20, **sampling)
        full = run_jobs(tiny, [request]).tokens["r"]
        engine = Engine(tiny, EngineConfig(kv_budget_bytes=16 * MiB))
        engine.submit(request, resume_ids=full[:9])
        assert full[:9] + Run(engine).drain().tokens["r"] == full


def test_a_bias_outside_the_vocabulary_is_rejected_invalid(tiny: LoadedModel) -> None:
    engine = Engine(tiny, EngineConfig(kv_budget_bytes=16 * MiB))
    assert not engine.submit(_job("b", 4, logit_bias={"100000": 1.0})).accepted
    finished = Run(engine).drain().finished["b"]
    assert finished.event.reason is FinishReason.REJECTED
    assert (
        finished.event.error is not None
        and "outside the vocabulary" in finished.event.error.message
    )
