"""The seam between the engine and a model: what the engine needs to know, and one call per tick.

    runner.allocate_kv(num_blocks, block_size)          # once, from the node's budget
    tokens = runner.execute(plan, sampling)              # every tick: one sampled token
    runner.release(session_id)                           #   per plan.sampling_ids entry

`execute` returns a plain `list[int]`, or a `Sampled` (the same tokens plus their
logprobs) when a session of the tick asked for logprobs (`ResolvedSampling.logprobs`)
or a prefill chunk is of a session that asked for its prompt's (`SeqState.prompt_logprobs`);
a runner that never computes logprobs always returns the list.

The engine (admission, scheduling, job lifecycle) holds no torch and no model:
everything it knows about one comes from `ModelSpec` and `scratch_bytes`, and
everything it asks of one is `execute`. `TorchRunner` (`tokenfleet.model.torch_runner`)
is today's implementation; a static-shape or CUDA-graph runner, or another
engine backend, implements the same four methods. A fake runner in the tests
drives the whole engine with torch not even importable.

A runner owns what is per session on its side (a sampler's random stream) and
frees it in `release`; the KV blocks themselves are the scheduler's, and the
plan's block tables say where each token's K/V lives.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Any, Protocol

from tokenfleet.kv import KVLayout
from tokenfleet.protocol import MAX_LOGIT_BIAS, MAX_TOP_LOGPROBS

if TYPE_CHECKING:
    from tokenfleet.model.tokenizer import Tokenizer


@dataclass(frozen=True)
class ResolvedSampling:
    """How one session picks its tokens: validated once, when the job is read.

    Penalties and bias adjust the session's logits row before temperature, top-k and
    top-p (`tokenfleet.model.penalties`); their defaults switch them off. `logprobs`
    asks the runner for the sampled token's logprob (0) and the k best (k > 0)."""

    temperature: float = 0.0  # 0 = greedy argmax
    top_k: int = 0  # 0 = no top-k filter
    top_p: float = 1.0  # 1 = no nucleus filter
    seed: int = 0
    presence_penalty: float = 0.0  # OpenAI's, over generated tokens; 0 = off
    frequency_penalty: float = 0.0  # OpenAI's, over generated tokens; 0 = off
    repetition_penalty: float = 1.0  # vLLM's (CTRL), over prompt + generated; 1 = off
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit)
    logprobs: int | None = None  # None: none computed; 0: the sampled token's; k: top k too

    def __post_init__(self) -> None:
        if not self.temperature >= 0:  # also rejects NaN
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not 0 < self.repetition_penalty <= 100:
            raise ValueError(
                f"repetition_penalty must be > 0 (1 disables it), got {self.repetition_penalty}"
            )
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise ValueError(
                f"logit_bias has {len(self.logit_bias)} entries, limit {MAX_LOGIT_BIAS}"
            )
        for token, bias in self.logit_bias:
            if token < 0 or not -100 <= bias <= 100:
                raise ValueError(
                    f"logit_bias {token}: {bias} is not a token id and a bias in [-100, 100]"
                )
        if len({token for token, _ in self.logit_bias}) != len(self.logit_bias):
            raise ValueError("logit_bias names a token twice")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"logprobs must be in 0..{MAX_TOP_LOGPROBS}, got {self.logprobs}")

    @classmethod
    def create(
        cls, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int | None = None
    ) -> ResolvedSampling:
        """Validated parameters; a random seed when `seed` is None."""
        return cls(temperature, top_k, top_p, secrets.randbits(63) if seed is None else seed)

    @property
    def penalized(self) -> bool:
        """Whether any penalty or bias changes the logits."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.logit_bias
        )


@dataclass(frozen=True)
class SamplingDefaults:
    """A model's own sampling defaults (its `generation_config.json`), applied to what a
    job leaves unset, as vLLM does; what neither sets is greedy with no filter."""

    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None

    @classmethod
    def from_generation_config(cls, config: dict[str, Any]) -> SamplingDefaults:
        """The valid `temperature`, `top_k` and `top_p` values of a generation config
        (others are left out: a bad file never stops a model from loading). As in vLLM,
        `do_sample` is not consulted: serving follows the values the model ships."""
        temperature, top_k, top_p = (config.get(k) for k in ("temperature", "top_k", "top_p"))
        number = (int, float)
        return cls(
            temperature=float(temperature)
            if isinstance(temperature, number) and 0 <= temperature <= 10
            else None,
            top_k=top_k if isinstance(top_k, int) and top_k >= 0 else None,
            top_p=float(top_p) if isinstance(top_p, number) and 0 < top_p <= 1 else None,
        )

    def as_fields(self) -> dict[str, float | int]:
        """The values that are set, e.g. for the worker hash."""
        values = {"temperature": self.temperature, "top_k": self.top_k, "top_p": self.top_p}
        return {k: v for k, v in values.items() if v is not None}

    def resolve(
        self,
        temperature: float | None,
        top_k: int | None,
        top_p: float | None,
        seed: int | None,
    ) -> ResolvedSampling:
        """A job's values, else these defaults, else greedy / no top-k / no top-p."""

        def pick(given: Any, default: Any, fallback: Any) -> Any:
            return given if given is not None else default if default is not None else fallback

        return ResolvedSampling.create(
            pick(temperature, self.temperature, 0.0),
            pick(top_k, self.top_k, 0),
            pick(top_p, self.top_p, 1.0),
            seed,
        )


@dataclass(frozen=True)
class ModelSpec:
    """What the engine needs to know about a model to budget and validate jobs for it."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    kv_dtype_bytes: int  # bytes of one cached K or V element
    weight_bytes: int  # resident bytes of the weights
    vocab_size: int
    max_context: int  # prompt + generated tokens one session may reach
    eos_token_ids: frozenset[int]
    sampling_defaults: SamplingDefaults = field(default_factory=SamplingDefaults)
    # what makes this model's KV differ from another's with the same shapes (weights,
    # dtype, quantization): the root of its prefix-cache addresses
    cache_identity: str = ""
    # whether a session may start from KV blocks another session wrote (the prefix
    # cache); a runner whose KV is not addressed by the plan's block tables says no
    shares_prefix: bool = True
    # the most KV tokens one session may hold on this runner, whatever the node's budget
    # (a llama.cpp runner with a KV stream per sequence: one stream's cells); None: the
    # node's KV budget is the only bound
    max_session_tokens: int | None = None

    def kv_layout(self, block_size: int) -> KVLayout:
        return KVLayout(
            self.num_layers, self.num_kv_heads, self.head_dim, self.kv_dtype_bytes, block_size
        )


class TokenMasks(Protocol):
    """The token masks of one tick's structured sessions (`worker.grammar.MaskJobs`)."""

    def __contains__(self, session_id: object) -> bool: ...

    def get(self, session_id: str) -> bytes: ...


@dataclass(frozen=True)
class TokenLogprobs:
    """One sampled position's logprobs: log-softmax of the raw model logits (before
    penalties, bias, grammar mask, temperature and filters, as OpenAI and vLLM report)."""

    logprob: float  # the sampled token's
    top: tuple[tuple[int, float], ...] = ()  # the k best (token id, logprob), best first


@dataclass(frozen=True)
class PromptLogprobs:
    """A prefill chunk's prompt logprobs: `logprobs[i]` is prompt token `first + i`'s,
    from the logits at the position before it."""

    first: int  # >= 1: the first prompt token has none
    logprobs: list[TokenLogprobs]


@dataclass(frozen=True)
class Sampled:
    """`execute`'s answer when some session asked for logprobs."""

    tokens: list[int]  # one per plan.sampling_ids entry
    logprobs: list[TokenLogprobs | None]  # the same positions; None: that session asked none
    # by session id: the prompt tokens a prefill chunk of this plan gave logprobs for
    prompt: dict[str, PromptLogprobs] = field(default_factory=dict)


class ModelRunner(Protocol):
    """A model the engine can run: see the module docstring for the call sequence."""

    @property
    def spec(self) -> ModelSpec: ...

    @property
    def tokenizer(self) -> Tokenizer | None:
        """The model's tokenizer; None when jobs must send token ids."""

    def scratch_bytes(self, context_len: int) -> int:
        """Activation memory one session needs for a decode step over `context_len` tokens."""

    def allocate_kv(self, num_blocks: int, block_size: int) -> None:
        """Allocate the KV pool the plans' block tables index into (called once)."""

    def execute(
        self,
        plan: TickPlan,
        sampling: Mapping[str, ResolvedSampling],
        masks: TokenMasks | None = None,
    ) -> list[int] | Sampled:
        """Run one tick: write every planned token's K/V and return one sampled token per
        `plan.sampling_ids` entry, in that order. `sampling` holds those sessions'
        parameters; `masks` (structured output), the allowed tokens of some of them, as
        a bitmask (bit i of 32-bit word i // 32: token i), passed only when there are
        any. A `Sampled` carries the logprobs of the sessions whose `logprobs` is set
        (a plain list is fine when none is), and those of the prompt tokens of every
        chunk whose session has `prompt_logprobs` set: for a chunk feeding positions
        start..end-1, those of the prompt tokens at start+1..end that exist (the logits at
        position p give the token at p + 1; the first prompt token has none). Raising
        means no token of this plan was sampled."""

    def recomputed(self, session_id: str) -> int:
        """Tokens of the session's cached prefix (`SeqState.num_cached`) this runner
        computed again, not having them any more: they were not served from the cache
        (its usage reports them as computed). 0 where the cache's blocks always serve."""

    def release(self, session_id: str) -> None:
        """Forget a session that ended or moved away (a no-op for one never executed)."""


class SeqStatus(StrEnum):
    WAITING = "waiting"  # admitted, KV reserved, no prefill yet
    PREFILL = "prefill"  # part of all_ids is in the cache
    DECODE = "decode"  # first token sampled; one token per tick from now on
    FINISHED = "finished"


@dataclass(eq=False)
class SeqState:
    session_id: str
    prompt_ids: list[int]
    max_new_tokens: int  # the job's whole budget, resumed outputs included
    output_ids: list[int] = field(default_factory=list)  # the session's, read-only here
    num_computed: int = 0
    status: SeqStatus = SeqStatus.WAITING
    # Prefix caching: the chain's root (None: this session neither shares nor registers)
    # and the content addresses of its full blocks, known ones first (those of the
    # tokens before the last one at admission), extended as blocks fill.
    hash_root: bytes | None = None
    block_hashes: list[bytes] = field(default_factory=list)
    num_registered: int = 0  # leading blocks registered (or found) in the cache
    num_cached: int = 0  # leading tokens whose KV the cache supplied
    looked_up: bool = False  # its lookup is counted in the cache's stats
    # echo: the runner reports each prompt token's logprob and the k best there (its
    # prefill computes every prompt position's logits; such a session shares no cache)
    prompt_logprobs: int | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def prefill_remaining(self) -> int:
        """Tokens still to feed before the first sample (0 once decoding)."""
        if self.status in (SeqStatus.WAITING, SeqStatus.PREFILL):
            return self.num_tokens - self.num_computed
        return 0

    @property
    def remaining_new_tokens(self) -> int:
        return self.max_new_tokens - len(self.output_ids)

    @property
    def max_kv_tokens(self) -> int:
        """Worst-case token slots: what admission checks and `add` reserves."""
        return len(self.prompt_ids) + self.max_new_tokens


@dataclass(frozen=True)
class DecodeStep:
    """One decode token: input all_ids[-1] at `position`, attends over `context_len` slots."""

    seq: SeqState
    token_id: int
    position: int  # == context_len - 1
    context_len: int
    block_table: list[int]  # covers context_len slots


@dataclass(frozen=True)
class PrefillChunk:
    """Feeds all_ids[start:start+length] at positions start..start+length-1."""

    seq: SeqState
    start: int
    length: int
    samples: bool  # this chunk ends the prefill: sample the first token from its last logits
    block_table: list[int]  # covers context_len slots

    @property
    def context_len(self) -> int:
        return self.start + self.length

    @property
    def token_ids(self) -> list[int]:
        return self.seq.all_ids[self.start : self.start + self.length]


@dataclass(frozen=True)
class TickPlan:
    decode: list[DecodeStep]
    prefill: list[PrefillChunk]

    @property
    def is_empty(self) -> bool:
        return not self.decode and not self.prefill

    @property
    def entries(self) -> list[DecodeStep | PrefillChunk]:
        """Every entry in forward order: decode steps, then prefill chunks."""
        return [*self.decode, *self.prefill]

    @property
    def num_decode_tokens(self) -> int:
        return len(self.decode)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(c.length for c in self.prefill)

    @property
    def sampling_ids(self) -> list[str]:
        """Sessions that get a sampled token from this tick, in plan order."""
        ids = [d.seq.session_id for d in self.decode]
        return ids + [c.seq.session_id for c in self.prefill if c.samples]
