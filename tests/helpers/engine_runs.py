"""Driving an `Engine` to the end in process: shared by the runner-seam tests (a fake
runner) and the sim runner's."""

from __future__ import annotations

from tokenfleet.protocol import GenerationRequest, SamplingParams
from tokenfleet.reasons import FinishReason
from tokenfleet.worker.engine import Engine


def request(job_id: str, prompt: list[int], n: int, seed: int = 0) -> GenerationRequest:
    """A job of `n` tokens that ignores end-of-sequence."""
    return GenerationRequest(
        job_id=job_id,
        prompt_ids=prompt,
        max_new_tokens=n,
        ignore_eos=True,
        sampling=SamplingParams(seed=seed),
    )


def run_all(engine: Engine) -> dict[str, list[int]]:
    """Step until nothing is left; every job must end `length`. Job id -> its tokens."""
    results: dict[str, list[int]] = {}
    for _ in range(10_000):
        if not engine.has_work:
            break
        for done in engine.step().finished:
            assert done.result.finish_reason is FinishReason.LENGTH, done.result
            results[done.job_id] = list(done.result.token_ids)
    assert not engine.has_work
    return results
