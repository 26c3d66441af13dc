"""What every runner does after its forward: one batched sample, and the logprobs asked for.

A runner turns a `TickPlan` into logits its own way (`TorchRunner`: one torch forward;
`LlamaCppRunner`: one `llama_decode`), then hands them here:

    sampler = TickSampler()
    states = sampler.states(plan, sampling)             # one stream per sampling entry
    echoes = [Echo.of(chunk, row) ...]                  # chunks asking for prompt logprobs
    logits [sampled, vocab], prompt [echo rows, vocab]  # the runner's forward
    sampler.finish(plan, sampling, masks, states, logits, prompt, echoes)

so seeds, penalties, grammars and logprobs behave the same on every runner. Logprobs
come from the raw model logits (before penalties, bias, grammar mask, temperature and
filters), as OpenAI and vLLM (its default "raw_logprobs") report them; a tick where no
session asks for any computes none and returns the plain list.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from tokenfleet.model.sampling import Sampler, SamplingState
from tokenfleet.seam import (
    DecodeStep,
    PrefillChunk,
    PromptLogprobs,
    ResolvedSampling,
    Sampled,
    SeqState,
    TickPlan,
    TokenLogprobs,
    TokenMasks,
)

__all__ = ["Echo", "TickSampler"]


class TickSampler:
    """One sampler stream per session (kept across ticks, dropped by `release`)."""

    def __init__(self) -> None:
        self.sampler = Sampler()
        self._streams: dict[str, SamplingState] = {}

    def states(
        self, plan: TickPlan, sampling: Mapping[str, ResolvedSampling]
    ) -> list[SamplingState]:
        """The streams of `plan.sampling_ids`, in that order."""
        entries: list[DecodeStep | PrefillChunk] = [*plan.decode]
        entries += [c for c in plan.prefill if c.samples]
        return [self._stream(e.seq, sampling) for e in entries]

    def _stream(self, seq: SeqState, sampling: Mapping[str, ResolvedSampling]) -> SamplingState:
        state = self._streams.get(seq.session_id)
        if state is None:
            # A resumed session skips the uniforms its emitted tokens used.
            state = SamplingState.for_params(sampling[seq.session_id], draws=len(seq.output_ids))
            self._streams[seq.session_id] = state
        if state.penalties is not None:  # counts what was emitted since the last tick
            state.penalties.observe(seq.prompt_ids, seq.output_ids)
        return state

    def release(self, session_id: str) -> None:
        self._streams.pop(session_id, None)

    def finish(
        self,
        plan: TickPlan,
        sampling: Mapping[str, ResolvedSampling],
        masks: TokenMasks | None,
        states: list[SamplingState],
        logits: torch.Tensor,
        prompt: torch.Tensor | None = None,
        echoes: list[Echo] | None = None,
    ) -> list[int] | Sampled:
        """Sample one token per `plan.sampling_ids` entry from `logits` [sampled, vocab]
        (never written in place), with the logprobs asked for; `prompt` holds the raw
        logits of the `echoes`' rows, in order."""
        echoed = prompt_logprobs(prompt, echoes) if prompt is not None and echoes else {}
        if not states:
            return Sampled([], [], echoed) if echoed else []
        raw = logits
        if masks:
            logits = apply_masks(logits, plan.sampling_ids, masks)
        tokens = self.sampler.sample(logits, states)
        asked = [sampling[sid].logprobs for sid in plan.sampling_ids]
        if all(k is None for k in asked):
            return Sampled(tokens, [None] * len(tokens), echoed) if echoed else tokens
        return Sampled(tokens, _logprobs(raw, tokens, asked), echoed)


def _logprobs(
    raw: torch.Tensor, tokens: list[int], asked: list[int | None]
) -> list[TokenLogprobs | None]:
    """Log-softmax of the raw logits [sampled, vocab] at each sampled token, and the k best
    of the rows whose `asked` is k (0: the sampled token's alone, None: nothing)."""
    rows = [i for i, k in enumerate(asked) if k is not None]
    asking = raw if len(rows) == len(asked) else raw[rows]  # [A, vocab]
    found = _pick_logprobs(asking, [tokens[i] for i in rows], max(asked[i] or 0 for i in rows))
    out: list[TokenLogprobs | None] = [None] * len(asked)
    for a, i in enumerate(rows):
        k = asked[i] or 0
        out[i] = TokenLogprobs(found[a].logprob, found[a].top[:k])
    return out


def _pick_logprobs(raw: torch.Tensor, targets: list[int], k: int) -> list[TokenLogprobs]:
    """Each row's log-softmax at its target token, and its k best, from raw logits
    [rows, vocab] (one copy to the host; a -inf is reported as OpenAI's -9999)."""
    lp = torch.log_softmax(raw.float(), dim=-1)  # [rows, vocab]
    at = torch.tensor(targets, device=lp.device)
    picked = lp[torch.arange(len(targets), device=lp.device), at]  # [rows]
    top_lp, top_ids = lp.topk(k, dim=-1)  # [rows, k], best first
    values = torch.cat([picked[:, None], top_lp], dim=1).clamp(-9999.0, 0.0).cpu().tolist()
    ids = top_ids.cpu().tolist()
    return [
        TokenLogprobs(v[0], tuple(zip(i, v[1:], strict=True)))
        for v, i in zip(values, ids, strict=True)
    ]


@dataclass(frozen=True)
class Echo:
    """A prefill chunk whose prompt tokens `first`.. get logprobs: from the logits of the
    flat forward rows `rows` (the positions just before them), `k` best each."""

    session_id: str
    first: int
    targets: list[int]
    rows: range
    k: int

    @classmethod
    def of(cls, chunk: PrefillChunk, row: int) -> Echo | None:
        """`row`: the flat row of the chunk's first token in the forward."""
        k, prompt = chunk.seq.prompt_logprobs, chunk.seq.prompt_ids
        first = max(1, chunk.start + 1)
        # targets first..end-1: the tokens after each fed position, within the prompt
        end = min(chunk.start + chunk.length + 1, len(prompt))
        if k is None or end <= first:
            return None
        at = row + first - 1 - chunk.start  # the row of position first - 1
        return cls(chunk.seq.session_id, first, prompt[first:end], range(at, at + end - first), k)


def prompt_logprobs(raw: torch.Tensor, echoes: list[Echo]) -> dict[str, PromptLogprobs]:
    """Each echo chunk's prompt logprobs, from the raw logits of its rows [sum(rows), vocab]."""
    found = _pick_logprobs(raw, [t for e in echoes for t in e.targets], max(e.k for e in echoes))
    out: dict[str, PromptLogprobs] = {}
    at = 0
    for e in echoes:
        part = found[at : at + len(e.targets)]
        at += len(e.targets)
        out[e.session_id] = PromptLogprobs(
            e.first, [TokenLogprobs(p.logprob, p.top[: e.k]) for p in part]
        )
    return out


def apply_masks(logits: torch.Tensor, ids: list[str], masks: TokenMasks) -> torch.Tensor:
    """-inf on every token a structured session's grammar does not allow now."""
    vocab = logits.shape[1]
    bits = torch.arange(32, dtype=torch.int32)
    out = logits.clone()
    for row, sid in enumerate(ids):
        if sid not in masks:
            continue
        words = torch.frombuffer(bytearray(masks.get(sid)), dtype=torch.int32)
        allowed = ((words[:, None] >> bits) & 1).flatten()[:vocab].bool()
        if allowed.shape[0] < vocab:  # tokens past the grammar's vocabulary: never
            allowed = torch.cat([allowed, allowed.new_zeros(vocab - allowed.shape[0])])
        out[row].masked_fill_(~allowed.to(out.device), float("-inf"))
    return out
