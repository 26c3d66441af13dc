"""Per-row sampling: greedy, top-k/top-p, and seeds that ignore the rest of the batch."""

from __future__ import annotations

import pytest
import torch

from tokenfleet.model import Sampler, SamplingState

VOCAB = 1000


def _logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def _run(logits_per_step: list[torch.Tensor], states: list[SamplingState]) -> list[list[int]]:
    sampler = Sampler()
    out: list[list[int]] = [[] for _ in states]
    for logits in logits_per_step:
        for row, token in zip(out, sampler.sample(logits, states), strict=True):
            row.append(token)
    return out


def test_all_greedy_is_argmax() -> None:
    logits = _logits(5)
    states = [SamplingState.from_params() for _ in range(5)]
    assert Sampler().sample(logits, states) == logits.argmax(-1).tolist()
    assert all(s.draws == 0 for s in states)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_greedy_picks_what_torchs_argmax_picks_with_ties_and_nans(dtype: torch.dtype) -> None:
    """The NumPy argmax behind greedy rows: the lowest id among equal maxima, a NaN as the
    maximum, the same in every dtype, and rows that are views of a wider tensor."""
    logits = _logits(6).to(dtype)
    logits[1, 10] = logits[1, 900] = logits[1].max() + 1  # a tie: 10 wins
    logits[2, 40] = logits[2, 7] = float("nan")  # the first NaN wins
    logits[3] = 0.0  # all equal: id 0
    logits[4, 999] = float("inf")
    wide = torch.cat([logits, logits], dim=1)[:, VOCAB:]  # strided rows
    states = [SamplingState.from_params() for _ in range(6)]
    for x in (logits, wide):
        got = Sampler().sample(x, states)
        assert got == x.float().argmax(-1).tolist()
        assert got[1:5] == [10, 7, 0, 999]


def test_greedy_rows_in_a_mixed_batch_take_argmax_without_drawing() -> None:
    logits = _logits(4)
    states = [SamplingState.from_params(temperature=t, seed=1) for t in (0.0, 1.0, 0.0, 0.7)]
    tokens = Sampler().sample(logits, states)
    assert tokens[0] == int(logits[0].argmax()) and tokens[2] == int(logits[2].argmax())
    assert [s.draws for s in states] == [0, 1, 0, 1]


def test_same_seed_same_tokens_whatever_the_batch() -> None:
    steps = 30
    mine = [_logits(1, seed=100 + i)[0] for i in range(steps)]  # this request's logits

    def params() -> SamplingState:
        return SamplingState.from_params(temperature=0.9, top_k=50, top_p=0.9, seed=42)

    alone = _run([m[None] for m in mine], [params()])[0]

    # The same request at row 2 of a batch of 6 with different neighbours and params
    # (some greedy, some unfiltered, which take other code paths), then at row 0.
    for position, neighbours_seed in ((2, 1), (0, 2)):
        others = [
            SamplingState.from_params(temperature=1.3, seed=7),
            SamplingState.from_params(),
            SamplingState.from_params(temperature=0.5, top_p=0.5, seed=8),
            SamplingState.from_params(temperature=1.0, top_k=3),
            SamplingState.from_params(temperature=2.0, seed=9),
        ]
        states = [*others[:position], params(), *others[position:]]
        batches = []
        for i, m in enumerate(mine):
            rows = _logits(6, seed=neighbours_seed * 1000 + i)
            rows[position] = m
            batches.append(rows)
        assert _run(batches, states)[position] == alone


def test_unseeded_states_differ_and_seeded_ones_repeat() -> None:
    a, b = SamplingState.from_params(temperature=1.0), SamplingState.from_params(temperature=1.0)
    assert a.seed != b.seed
    logits = [_logits(1, seed=i) for i in range(20)]
    s1 = _run(logits, [SamplingState.from_params(temperature=1.0, seed=5)])
    s2 = _run(logits, [SamplingState.from_params(temperature=1.0, seed=5)])
    s3 = _run(logits, [SamplingState.from_params(temperature=1.0, seed=6)])
    assert s1 == s2 and s1 != s3


def test_resume_after_draws_continues_the_stream() -> None:
    logits = [_logits(1, seed=i) for i in range(20)]
    full = _run(logits, [SamplingState.from_params(temperature=1.0, seed=3)])[0]
    resumed = _run(logits[12:], [SamplingState.from_params(temperature=1.0, seed=3, draws=12)])
    assert resumed[0] == full[12:]


def test_top_k_one_and_tiny_top_p_are_greedy() -> None:
    logits = _logits(8)
    logits[3, 17] = logits[3].max()  # a tie: the lower id must win, as argmax does
    greedy = logits.argmax(-1).tolist()
    for top_k, top_p in ((1, 1.0), (0, 1e-6), (5, 1e-9)):
        states = [
            SamplingState.from_params(temperature=1.5, top_k=top_k, top_p=top_p, seed=i)
            for i in range(8)
        ]
        for _ in range(5):
            assert Sampler().sample(logits, states) == greedy


def test_top_k_restricts_support() -> None:
    logits = _logits(1)
    top5 = set(logits[0].topk(5).indices.tolist())
    state = SamplingState.from_params(temperature=5.0, top_k=5, seed=0)
    seen = {Sampler().sample(logits, [state])[0] for _ in range(300)}
    assert seen == top5


def test_top_p_keeps_the_nucleus() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    state = SamplingState.from_params(temperature=1.0, top_p=0.75, seed=0)
    seen = {Sampler().sample(logits, [state])[0] for _ in range(300)}
    assert seen == {0, 1}  # 0.5 < 0.75, 0.5 + 0.3 reaches it: token 2 is cut


def test_distribution_matches_softmax() -> None:
    probs = torch.tensor([0.6, 0.25, 0.1, 0.05])
    logits = torch.log(probs)[None].repeat(4000, 1) * 2.0  # temperature 2 undoes the * 2
    states = [SamplingState.from_params(temperature=2.0, seed=i) for i in range(4000)]
    counts = torch.bincount(torch.tensor(Sampler().sample(logits, states)), minlength=4)
    freq = counts.float() / 4000
    # 4000 draws: a binomial's standard deviation is at most ~0.008
    assert torch.allclose(freq, probs, atol=0.03), freq


def test_invalid_params() -> None:
    with pytest.raises(ValueError, match="temperature"):
        SamplingState.from_params(temperature=-1)
    with pytest.raises(ValueError, match="top_p"):
        SamplingState.from_params(top_p=0)
    with pytest.raises(ValueError, match="top_k"):
        SamplingState.from_params(top_k=-2)
    with pytest.raises(ValueError, match="do not match"):
        Sampler().sample(_logits(2), [SamplingState.from_params()])
