"""`TorchRunner`: the engine's `ModelRunner` for the torch Llama model.

It owns the KV pool, the model's reusable tick buffers (through `LlamaModel`) and
one sampler stream per session, and turns the scheduler's `TickPlan` into one
forward pass plus one batched sample:

    plan.decode + plan.prefill  ->  input ids + SeqInputs  ->  LlamaModel.forward
    logits rows of the sampling entries  ->  Sampler.sample  ->  one token each
    the same rows, raw, of sessions asking for logprobs  ->  log_softmax  ->  `Sampled`

Logprobs come from the raw model logits (before penalties, bias, grammar mask,
temperature and filters), as OpenAI and vLLM (its default "raw_logprobs") report them;
a tick where no session asks for any computes none and returns the plain list. A
prefill chunk of a session asking for its prompt's logprobs (echo) has the LM head run
over every prompt position it feeds, not its last one alone.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from tokenfleet.model.build import LoadedModel
from tokenfleet.model.kv_pool import KVPool
from tokenfleet.model.sampling import Sampler, SamplingState
from tokenfleet.model.tick_inputs import SeqInput
from tokenfleet.model.tokenizer import Tokenizer
from tokenfleet.seam import (
    DecodeStep,
    ModelSpec,
    PrefillChunk,
    PromptLogprobs,
    ResolvedSampling,
    Sampled,
    SeqState,
    TickPlan,
    TokenLogprobs,
    TokenMasks,
)

ForwardObserver = Callable[[list[int], list[SeqInput]], None]


class TorchRunner:
    """`on_forward`, when given, sees every forward's input ids and sequences before it
    runs (benchmarks record schedules with it; nothing else changes)."""

    def __init__(self, loaded: LoadedModel, *, on_forward: ForwardObserver | None = None) -> None:
        self.loaded = loaded
        self.on_forward = on_forward
        self.model = loaded.model
        cfg = loaded.config
        self._dtype_bytes = torch.empty((), dtype=loaded.dtype).element_size()
        eos = () if loaded.tokenizer is None else loaded.tokenizer.eos_token_ids
        self._spec = ModelSpec(
            num_layers=cfg.num_layers,
            num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            kv_dtype_bytes=self._dtype_bytes,
            weight_bytes=loaded.weight_bytes,
            vocab_size=cfg.vocab_size,
            max_context=cfg.max_position_embeddings,
            eos_token_ids=frozenset(eos) | frozenset(cfg.eos_token_ids),
            sampling_defaults=loaded.sampling_defaults,
            cache_identity=_identity(loaded),
        )
        self.kv: KVPool | None = None
        self.sampler = Sampler()
        self._streams: dict[str, SamplingState] = {}

    @property
    def spec(self) -> ModelSpec:
        return self._spec

    @property
    def tokenizer(self) -> Tokenizer | None:
        return self.loaded.tokenizer

    def scratch_bytes(self, context_len: int) -> int:
        # One decode token attending over its whole context: gathered K/V, scores,
        # its logits row and sampling buffers.
        return self.loaded.config.scratch_bytes(
            1, context_len=context_len, logit_rows=1, dtype_bytes=self._dtype_bytes
        )

    def allocate_kv(self, num_blocks: int, block_size: int) -> None:
        self.kv = self.model.new_kv_pool(num_blocks, block_size)

    def execute(
        self,
        plan: TickPlan,
        sampling: Mapping[str, ResolvedSampling],
        masks: TokenMasks | None = None,
    ) -> list[int] | Sampled:
        if self.kv is None:
            raise RuntimeError("allocate_kv() before execute()")
        ids: list[int] = []
        seqs: list[SeqInput] = []
        sample_rows: list[int] = []
        states: list[SamplingState] = []
        echoes: list[_Echo] = []  # prefill chunks of sessions asking for prompt logprobs
        for row, entry in enumerate(plan.entries):
            if isinstance(entry, DecodeStep):
                ids.append(entry.token_id)
                seqs.append(SeqInput(entry.block_table, entry.position, 1))
            else:
                echo = _Echo.of(entry, len(ids))
                if echo is not None:
                    echoes.append(echo)
                ids.extend(entry.token_ids)
                seqs.append(SeqInput(entry.block_table, entry.start, entry.length))
                if not entry.samples:
                    continue
            sample_rows.append(row)
            states.append(self._stream(entry.seq, sampling))
        if self.on_forward is not None:
            self.on_forward(ids, seqs)
        if echoes:  # every prompt position's logits these chunks need, after the samples'
            ends = list(itertools.accumulate(s.num_new for s in seqs))
            flat = [ends[r] - 1 for r in sample_rows]
            flat += [r for e in echoes for r in e.rows]
            every = self.model.forward(ids, seqs, self.kv, flat)  # [samples + echoes, vocab]
            logits, prompt = every[: len(sample_rows)], every[len(sample_rows) :]
        else:
            logits = self.model.forward(ids, seqs, self.kv)  # [entries, vocab]
            if len(sample_rows) < len(seqs):
                logits = logits[sample_rows]
        echoed = _prompt_logprobs(prompt, echoes) if echoes else {}
        if not sample_rows:
            return Sampled([], [], echoed) if echoed else []
        raw = logits  # [sampled, vocab]: masks and the sampler never write it in place
        if masks:
            logits = _apply_masks(logits, plan.sampling_ids, masks)
        tokens = self.sampler.sample(logits, states)
        asked = [sampling[sid].logprobs for sid in plan.sampling_ids]
        if all(k is None for k in asked):
            return Sampled(tokens, [None] * len(tokens), echoed) if echoed else tokens
        return Sampled(tokens, _logprobs(raw, tokens, asked), echoed)

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
class _Echo:
    """A prefill chunk whose prompt tokens `first`.. get logprobs: from the logits of the
    flat forward rows `rows` (the positions just before them), `k` best each."""

    session_id: str
    first: int
    targets: list[int]
    rows: range
    k: int

    @classmethod
    def of(cls, chunk: PrefillChunk, row: int) -> _Echo | None:
        """`row`: the flat row of the chunk's first token in the forward."""
        k, prompt = chunk.seq.prompt_logprobs, chunk.seq.prompt_ids
        first = max(1, chunk.start + 1)
        # targets first..end-1: the tokens after each fed position, within the prompt
        end = min(chunk.start + chunk.length + 1, len(prompt))
        if k is None or end <= first:
            return None
        at = row + first - 1 - chunk.start  # the row of position first - 1
        return cls(chunk.seq.session_id, first, prompt[first:end], range(at, at + end - first), k)


def _prompt_logprobs(raw: torch.Tensor, echoes: list[_Echo]) -> dict[str, PromptLogprobs]:
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


def _apply_masks(logits: torch.Tensor, ids: list[str], masks: TokenMasks) -> torch.Tensor:
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


def _identity(loaded: LoadedModel) -> str:
    """The model as far as its KV goes: architecture, weights (a digest of a few
    parameters' values: same shapes, other weights, other cache), dtype, quantization."""
    h = hashlib.blake2b(digest_size=16)
    h.update(repr(loaded.config).encode())
    h.update(f"{loaded.dtype}|{loaded.quant}|{loaded.weight_bytes}".encode())
    if loaded.model.deterministic is not None:  # other numerics: other KV bits
        h.update(b"|deterministic")
    for _, tensor in itertools.islice(loaded.model.state_dict().items(), 4):
        flat = tensor.detach().reshape(-1)[:256]
        h.update(flat.to("cpu", torch.float32).numpy().tobytes())
    return h.hexdigest()
