"""One prefill for a prefix several sessions need at once (issue 23, part 5).

The n choices of one request are n jobs with the same prompt, admitted together. Before
this, the prefix cache only shared a block once a prefill had registered it, so jobs
admitted in one tick all prefilled the prompt side by side. Now a session about to start
whose next block another session is computing waits in line until that prefill
registers it, then takes it from the cache (`Scheduler._look_up`). In process, the
tiny-random model, no Redis: the engine's own counters and each job's usage prove it.
"""

from __future__ import annotations

import pytest

from tokenfleet.model import LoadedModel, load_model
from tokenfleet.protocol import GenerationRequest
from tokenfleet.reasons import FinishReason
from tokenfleet.worker.engine import Engine, EngineConfig
from tokenfleet.worker.session import Finished

MiB = 1024 * 1024
BLOCK = 16
PROMPT = [(7 * k) % 230 + 3 for k in range(4 * BLOCK + 5)]  # 4 full blocks and 5 tokens


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    return load_model("tiny-random")


def engine(loaded: LoadedModel, *, prefill_per_tick: int = 256, cache: bool = True) -> Engine:
    return Engine(
        loaded,
        EngineConfig(
            kv_budget_bytes=8 * MiB,
            max_active=8,
            max_batch_size=8,
            max_prefill_tokens_per_tick=prefill_per_tick,
            max_waiting=8,
            block_size=BLOCK,
            prefix_cache=cache,
        ),
    )


def choices(n: int, prompt: list[int] = PROMPT, **extra: object) -> list[GenerationRequest]:
    return [
        GenerationRequest(
            job_id=f"choice-{i}",
            prompt_ids=prompt,
            max_new_tokens=6,
            ignore_eos=True,
            **extra,  # type: ignore[arg-type]
        )
        for i in range(n)
    ]


class Run:
    """Submit everything before the first step, then step to the end."""

    def __init__(self, eng: Engine, jobs: list[GenerationRequest]) -> None:
        for job in jobs:
            assert eng.submit(job).accepted
        self.tokens: dict[str, list[int]] = {j.job_id: [] for j in jobs}
        self.finished: dict[str, Finished] = {}
        self.prefill: list[int] = []  # prompt tokens computed, tick by tick
        steps = 0
        while eng.has_work:
            out = eng.step()
            self.prefill.append(out.prefill_tokens)
            for event in out.tokens:
                self.tokens[event.job_id].append(event.token_id)
            for done in out.finished:
                self.finished[done.job_id] = done
            steps += 1
            assert steps < 500
        assert all(f.result.finish_reason is FinishReason.LENGTH for f in self.finished.values())

    @property
    def prefill_tokens(self) -> int:
        return sum(self.prefill)

    def cached(self) -> list[int]:
        return sorted(f.result.usage.cached_tokens for f in self.finished.values())


def test_three_choices_of_one_prompt_prefill_it_once(tiny: LoadedModel) -> None:
    eng = engine(tiny)  # 256 prefill tokens a tick: all three prompts fit one tick
    run = Run(eng, choices(3))
    full = 4 * BLOCK
    # the first computes the prompt; the other two find its 4 full blocks cached
    assert run.cached() == [0, full, full]
    stats = eng.blocks.stats
    assert (stats.hits_blocks, stats.hits_tokens) == (2 * 4, 2 * full)
    assert stats.queries_tokens == 3 * len(PROMPT)  # each lookup counted once
    # the prompt once, then each follower's own last 5 tokens
    assert run.prefill_tokens == len(PROMPT) + 2 * (len(PROMPT) - full)
    assert run.prefill[0] == len(PROMPT)  # the first tick: the leader alone; the others wait
    # the same greedy tokens as a lone job computing everything itself
    alone = Run(engine(tiny, cache=False), choices(1))
    assert all(tokens == alone.tokens["choice-0"] for tokens in run.tokens.values())
    eng.blocks.check_invariants()
    assert eng.blocks.num_in_use_blocks == 0


def test_a_prefix_longer_than_a_tick_is_still_prefilled_once(tiny: LoadedModel) -> None:
    """The leader's prefill takes two ticks (48 tokens each): after the first, 3 of its 4
    full blocks are cached, and the second has room to spare. The followers wait through
    both (rather than take 3 blocks and compute the 4th beside the leader), then start
    with every full block cached."""
    eng = engine(tiny, prefill_per_tick=48)
    run = Run(eng, choices(3, sampling={"temperature": 1.0, "seed": 11}))
    assert run.cached() == [0, 4 * BLOCK, 4 * BLOCK]
    assert eng.blocks.stats.hits_blocks == 2 * 4
    assert run.prefill_tokens == len(PROMPT) + 2 * 5
    # seeded sampling: the same seed and prompt give the same text, shared KV or not
    alone = Run(engine(tiny, cache=False), choices(1, sampling={"temperature": 1.0, "seed": 11}))
    assert all(tokens == alone.tokens["choice-0"] for tokens in run.tokens.values())


def test_sessions_that_share_no_prefix_never_wait(tiny: LoadedModel) -> None:
    """Different prompts (and the same prompt under another salt: another cache scope)
    all start in the first tick, as without the cache."""
    other = [t + 1 for t in PROMPT]
    jobs = [
        *choices(1),
        GenerationRequest(job_id="other", prompt_ids=other, max_new_tokens=6, ignore_eos=True),
        GenerationRequest(
            job_id="salted", prompt_ids=PROMPT, max_new_tokens=6, ignore_eos=True, cache_salt="s"
        ),
    ]
    eng = engine(tiny)
    run = Run(eng, jobs)
    assert run.prefill[0] == 3 * len(PROMPT)  # all three in the first tick
    assert run.cached() == [0, 0, 0]
    assert run.prefill_tokens == 3 * len(PROMPT)


def test_a_follower_whose_leader_is_cancelled_computes_the_rest_itself(
    tiny: LoadedModel,
) -> None:
    eng = engine(tiny, prefill_per_tick=32)
    for job in choices(2):
        assert eng.submit(job).accepted
    eng.step()  # the leader computed 2 blocks; the follower waits
    assert eng.blocks.stats.queries_tokens == len(PROMPT)  # the follower looked up nothing yet
    assert eng.cancel("choice-0")
    tokens: list[int] = []
    ended: dict[str, Finished] = {}
    while eng.has_work:
        out = eng.step()
        tokens += [e.token_id for e in out.tokens if e.job_id == "choice-1"]
        ended |= {f.job_id: f for f in out.finished}
    assert ended["choice-0"].result.finish_reason is FinishReason.CANCELLED
    follower = ended["choice-1"].result
    assert follower.finish_reason is FinishReason.LENGTH
    assert follower.usage.cached_tokens == 2 * BLOCK  # what the leader registered
    assert tokens == Run(engine(tiny, cache=False), choices(1)).tokens["choice-0"]
    eng.blocks.check_invariants()
