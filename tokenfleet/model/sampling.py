"""Choosing each sequence's next token from a batch of logits, with per-row parameters.

Every session owns a `SamplingState` with its own `torch.Generator`. A sampled
row consumes exactly one uniform draw from its own generator per token (inverse
CDF sampling), and all filtering is row-wise, so a request's tokens depend only
on its logits and its seed: never on what else shares the batch or the order of
rows. Greedy rows (temperature 0) draw nothing. One draw per token also makes a
seeded stream resumable: `from_params(..., draws=n)` continues after n tokens.

A session with penalties or a logit bias (`penalties.py`) has its row adjusted first,
before temperature and filters (greedy rows too); a batch where no session has any
pays nothing for them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from tokenfleet.model.penalties import Penalties
from tokenfleet.seam import ResolvedSampling


@dataclass
class SamplingState:
    """One session's sampling parameters and random stream."""

    temperature: float = 0.0  # 0 = greedy argmax
    top_k: int = 0  # 0 = no top-k filter
    top_p: float = 1.0  # 1 = no nucleus filter
    seed: int = 0
    draws: int = 0  # uniforms taken from the stream so far
    generator: torch.Generator = field(default_factory=torch.Generator, repr=False)
    penalties: Penalties | None = None  # None: the session uses none

    @classmethod
    def from_params(
        cls,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int | None = None,
        *,
        draws: int = 0,
    ) -> SamplingState:
        """Validate parameters and seed the stream (a random seed when `seed` is None).

        `draws` skips that many uniforms: a session resumed after n sampled tokens
        passes n and continues exactly where it stopped.
        """
        params = ResolvedSampling.create(temperature, top_k, top_p, seed)  # validates
        return cls.for_params(params, draws=draws)

    @classmethod
    def for_params(cls, params: ResolvedSampling, *, draws: int = 0) -> SamplingState:
        """The stream of a session with `params`, `draws` uniforms in."""
        generator = torch.Generator(device="cpu")
        generator.manual_seed(params.seed)
        p = params
        state = cls(p.temperature, p.top_k, p.top_p, p.seed, 0, generator, Penalties.of(p))
        for _ in range(draws):
            state.next_uniform()
        return state

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def filters(self) -> bool:
        """Whether top-k or top-p cut the distribution."""
        return self.top_k > 0 or self.top_p < 1.0

    def next_uniform(self) -> float:
        self.draws += 1
        return float(torch.rand((), generator=self.generator, dtype=torch.float64))


class Sampler:
    """Picks one token per row of logits [B, vocab] for B sessions' states."""

    def sample(self, logits: Tensor, states: Sequence[SamplingState]) -> list[int]:
        if logits.dim() != 2 or logits.shape[0] != len(states):
            raise ValueError(f"logits {tuple(logits.shape)} do not match {len(states)} states")
        if any(s.penalties is not None for s in states):
            logits = _penalized(logits, states)
        if all(s.is_greedy for s in states):  # fast path: one argmax for the batch
            return greedy_tokens(logits)

        # Sampling happens on CPU: the generators live there, which also makes a seed
        # give the same tokens on any device. [B, vocab] floats is a small copy.
        logits = logits.detach().float().cpu()
        tokens = greedy_tokens(logits)
        # Which path a row takes depends only on its own parameters, never on its
        # neighbours: a row must map the same uniform to the same token in any batch.
        plain = [i for i, s in enumerate(states) if not s.is_greedy and not s.filters]
        filtered = [i for i, s in enumerate(states) if not s.is_greedy and s.filters]
        for rows in (plain, filtered):
            if rows:
                group = [states[i] for i in rows]
                picked = _sample_rows(logits[rows], group, filtered=rows is filtered)
                for i, token in zip(rows, picked, strict=True):
                    tokens[i] = token
        return tokens


def greedy_tokens(logits: Tensor) -> list[int]:
    """Each row's argmax of logits [B, vocab]: the lowest id among equal maxima (a NaN
    counts as the maximum), as torch's argmax. On the CPU it is NumPy's, vectorized where
    torch's is not: 49,152 float32 logits took 7 vs 90 µs at one row, 28 vs 710 µs at
    eight (Xeon AMX, one thread; torch's took 0.54 ms of an 18 ms 8-row SmolLM2 tick in
    bench/tick_profile.py)."""
    if logits.device.type != "cpu":
        return [int(t) for t in logits.argmax(dim=-1).tolist()]
    rows = logits.detach()
    if rows.dtype not in (torch.float32, torch.float64):  # NumPy has no bfloat16
        rows = rows.float()
    return [int(t) for t in rows.numpy().argmax(axis=-1)]


def _penalized(logits: Tensor, states: Sequence[SamplingState]) -> Tensor:
    """A float32 copy of logits [B, vocab] with each penalized row adjusted."""
    out = logits.to(torch.float32, copy=True)
    for row, state in enumerate(states):
        if state.penalties is not None:
            out[row] = state.penalties.apply(out[row])
    return out


def _sample_rows(logits: Tensor, states: Sequence[SamplingState], *, filtered: bool) -> list[int]:
    """Inverse-CDF sampling of logits [R, vocab], one uniform from each row's stream."""
    x = logits / torch.tensor([[s.temperature] for s in states])  # [R, vocab]
    order: Tensor | None = None
    if filtered:
        probs, order = _filtered_probs(x, states)
    else:
        probs = torch.softmax(x, dim=-1)
    cdf = probs.cumsum(dim=-1)  # [R, vocab]
    picked: list[int] = []
    for r, s in enumerate(states):
        u = s.next_uniform() * float(cdf[r, -1])
        choice = min(int(torch.searchsorted(cdf[r], u, right=True)), cdf.shape[1] - 1)
        picked.append(choice if order is None else int(order[r, choice]))
    return picked


def _filtered_probs(x: Tensor, states: Sequence[SamplingState]) -> tuple[Tensor, Tensor]:
    """Softmax of temperature-scaled logits x [R, vocab] after top-k then top-p.

    Probabilities come back in descending-logit order; `order` [R, vocab] maps
    each position back to its token id.
    """
    vocab = x.shape[1]
    # stable: among equal logits the lower id ranks first, as argmax picks it
    sorted_x, order = x.sort(dim=-1, descending=True, stable=True)  # [R, vocab]
    ranks = torch.arange(vocab)[None, :]  # [1, vocab]
    k = torch.tensor([[s.top_k if s.top_k > 0 else vocab] for s in states])  # [R, 1]
    sorted_x = sorted_x.masked_fill(ranks >= k, float("-inf"))
    probs = torch.softmax(sorted_x, dim=-1)
    # Drop a token once the tokens ranked above it hold top_p of the mass (the first
    # always survives). top_p == 1 disables it: 2 is never reached, even with rounding.
    top_p = torch.tensor([[s.top_p if s.top_p < 1 else 2.0] for s in states])  # [R, 1]
    mass_before = probs.cumsum(dim=-1) - probs
    return probs.masked_fill(mass_before >= top_p, 0.0), order
