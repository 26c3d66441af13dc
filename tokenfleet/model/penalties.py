"""Penalties and logit bias: one session's logits row adjusted by the tokens it has seen.

Applied in this order, to the raw logits row (after the grammar mask: -inf stays
-inf under every rule), before temperature, top-k and top-p:

    repetition  (vLLM's repetition_penalty; CTRL, transformers' RepetitionPenaltyLogitsProcessor)
                over prompt + generated tokens: a positive logit is divided by p, a
                negative one multiplied by p
    frequency / presence  (OpenAI) over generated tokens only:
                logit[t] -= frequency * count[t] + presence * (count[t] > 0)
    logit_bias  (OpenAI) logit[t] += bias[t]

The counts are derived from the session's own token lists (the scheduler's `SeqState`,
whose output_ids are the session's emitted tokens): `observe` hands the lists over every
tick and `apply` counts what it has not counted yet. A state built for a resumed or
preempted session (its emitted tokens re-prefilled) therefore counts exactly what the
first one did, and a tick that failed before its tokens were emitted counts nothing.
The tensors live on the logits' device, made on first use: counts [vocab] float32,
seen [vocab] bool (repetition only), bias [vocab] float32.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from tokenfleet.seam import ResolvedSampling


@dataclass
class Penalties:
    presence: float = 0.0
    frequency: float = 0.0
    repetition: float = 1.0  # 1 = off
    bias: tuple[tuple[int, float], ...] = ()
    _prompt: Sequence[int] = field(default=(), repr=False)
    _output: Sequence[int] = field(default=(), repr=False)
    _counted: int = 0  # leading output tokens already in _counts / _seen
    _counts: Tensor | None = field(default=None, repr=False)  # [vocab] float32
    _seen: Tensor | None = field(default=None, repr=False)  # [vocab] bool
    _bias: Tensor | None = field(default=None, repr=False)  # [vocab] float32
    _made: bool = False  # the tensors exist

    @classmethod
    def of(cls, params: ResolvedSampling) -> Penalties | None:
        """The session's penalties; None when it uses none (then nothing is ever done)."""
        if not params.penalized:
            return None
        return cls(
            params.presence_penalty,
            params.frequency_penalty,
            params.repetition_penalty,
            params.logit_bias,
        )

    @property
    def counts_output(self) -> bool:
        return self.presence != 0.0 or self.frequency != 0.0

    def observe(self, prompt_ids: Sequence[int], output_ids: Sequence[int]) -> None:
        """The session's prompt and emitted tokens as of this tick (read, never copied)."""
        self._prompt = prompt_ids
        self._output = output_ids

    def apply(self, row: Tensor) -> Tensor:
        """A new float32 row [vocab] from `row` [vocab] under the rules above."""
        x = row.float()
        self._catch_up(x.shape[0], x.device)
        if self._seen is not None:
            p = self.repetition
            x = torch.where(self._seen, torch.where(x < 0, x * p, x / p), x)
        if self._counts is not None:
            x = x - self.frequency * self._counts
            if self.presence:
                x = x - self.presence * (self._counts > 0).float()
        if self._bias is not None:
            x = x + self._bias
        return x

    def _catch_up(self, vocab: int, device: torch.device) -> None:
        """Make the tensors on first use; count the output tokens not yet counted."""
        if not self._made:
            self._made = True
            if self.counts_output:
                self._counts = torch.zeros(vocab, dtype=torch.float32, device=device)
            if self.repetition != 1.0:
                self._seen = torch.zeros(vocab, dtype=torch.bool, device=device)
                if self._prompt:
                    self._seen[torch.tensor(list(self._prompt), device=device)] = True
            if self.bias:
                ids = torch.tensor([t for t, _ in self.bias], device=device)
                values = torch.tensor([b for _, b in self.bias], device=device)
                self._bias = torch.zeros(vocab, dtype=torch.float32, device=device)
                self._bias[ids] = values
        new = self._output[self._counted :]
        if not new:
            return
        ids = torch.tensor(list(new), device=device)
        if self._counts is not None:  # index_add_ counts a repeated id once per occurrence
            self._counts.index_add_(0, ids, torch.ones(len(new), device=device))
        if self._seen is not None:
            self._seen[ids] = True
        self._counted = len(self._output)
