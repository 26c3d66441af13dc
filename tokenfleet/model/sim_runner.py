"""A runner with no model that paces its ticks like a GPU: `tokenfleet worker --runner sim`.

It exists to load Redis the way real GPU workers would, from processes that mostly
sleep, so that 1…64 of them fit on a small machine (bench/coordination.py). A tick of
`rows` rows (decode steps plus prefill tokens fed) takes

    max(tick_floor_s, rows / tok_s)

like a forward pass with a fixed cost (launches, weights read once per step) and a
per-row cost: `tok_s` is the worker's rate at a full batch, and below
`tick_floor_s * tok_s` rows the floor rules, as a small batch on a GPU does.

Tokens are a pure function of (session id, position, seed), so a job resumed on
another worker, a preempted session and a batch of any size continue identically.
They are printable ASCII bytes of the byte tokenizer (one character each; the
tokenizer makes text prompts and the gateway work). EOS is never sampled unless
`eos_after` asks for it (then at that output index), so a job runs to its
`max_new_tokens`. Structured output is honoured: a session with a token mask gets the
first allowed id at or after the one it would have drawn. Logprobs are never
computed: `execute` always returns a plain list (`ResolvedSampling.logprobs` asks
for what this runner cannot give; the events simply carry none).

No torch, no numpy: the engine and this runner run where torch cannot even import.
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from tokenfleet.model.chat import SIMPLE_CHAT_TEMPLATE
from tokenfleet.model.tokenizer import ByteTokenizer
from tokenfleet.seam import DecodeStep, ModelSpec, ResolvedSampling, TickPlan, TokenMasks

__all__ = ["SIM_SPEC", "SimPace", "SimRunner", "sim_token"]

MASK64 = (1 << 64) - 1
FIRST, LAST = 0x20, 0x7E  # the printable ASCII bytes: what `sim_token` draws from

# A small fake model: 2 layers x 2 KV heads x 64 dims x 2 bytes, K and V = 1 KiB of KV
# per token, so the engine's KV budget admits and refuses jobs as it does for a model.
SIM_SPEC = ModelSpec(
    num_layers=2,
    num_kv_heads=2,
    head_dim=64,
    kv_dtype_bytes=2,
    weight_bytes=1 << 20,
    vocab_size=ByteTokenizer.PAD + 1,
    max_context=8192,
    eos_token_ids=frozenset({ByteTokenizer.EOS}),
    cache_identity="sim",
)


def _mix(x: int) -> int:
    """splitmix64's finaliser: 64 well-mixed bits out of 64."""
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def session_key(session_id: str) -> int:
    """The stable 32-bit key of a session id (the same in every process: not `hash`)."""
    return zlib.crc32(session_id.encode())


def sim_token(key: int, position: int, seed: int) -> int:
    """The token a session (`session_key`) samples at `position` with `seed`."""
    x = _mix((key << 32 ^ position * 0x9E3779B97F4A7C15 ^ seed) & MASK64)
    return FIRST + x % (LAST - FIRST + 1)


@dataclass(frozen=True)
class SimPace:
    """How long a tick takes: `max(tick_floor_s, rows / tok_s)`."""

    tok_s: float = 3000.0  # rows per second at a full batch
    tick_floor_s: float = 0.015  # the least time of any tick that runs

    def __post_init__(self) -> None:
        if not self.tok_s > 0:
            raise ValueError(f"tok_s must be > 0, got {self.tok_s}")
        if not self.tick_floor_s >= 0:
            raise ValueError(f"tick_floor_s must be >= 0, got {self.tick_floor_s}")

    def tick_s(self, rows: int) -> float:
        return max(self.tick_floor_s, rows / self.tok_s)


class SimRunner:
    """A `ModelRunner` (tokenfleet/seam.py) with no model: see the module docstring."""

    def __init__(
        self,
        pace: SimPace | None = None,
        *,
        spec: ModelSpec = SIM_SPEC,
        eos_after: int | None = None,
        clock: Callable[[], float] = time.perf_counter,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.pace = pace or SimPace()
        self._spec = spec
        self._tokenizer = ByteTokenizer(spec.vocab_size, chat_template=SIMPLE_CHAT_TEMPLATE)
        self._eos = min(spec.eos_token_ids) if spec.eos_token_ids else None
        self.eos_after = eos_after  # output index at which EOS is sampled; None: never
        self.clock = clock
        self.sleep = sleep
        self._keys: dict[str, int] = {}  # session id -> session_key, until released
        self.ticks = 0
        self.rows = 0  # rows of every tick so far
        self.slept_s = 0.0

    @property
    def spec(self) -> ModelSpec:
        return self._spec

    @property
    def tokenizer(self) -> ByteTokenizer:
        return self._tokenizer

    def scratch_bytes(self, context_len: int) -> int:
        return 64 * max(1, context_len)  # nominal: the budget's arithmetic stays real

    def allocate_kv(self, num_blocks: int, block_size: int) -> None:
        """Nothing to allocate: the plans' block tables are not read."""

    def execute(
        self,
        plan: TickPlan,
        sampling: Mapping[str, ResolvedSampling],
        masks: TokenMasks | None = None,
    ) -> list[int]:
        start = self.clock()
        tokens: list[int] = []
        for entry in plan.entries:
            if not (isinstance(entry, DecodeStep) or entry.samples):
                continue
            seq = entry.seq
            sid = seq.session_id
            key = self._keys.get(sid)
            if key is None:
                key = self._keys[sid] = session_key(sid)
            if self._eos_due(len(seq.output_ids)):
                assert self._eos is not None
                tokens.append(self._eos)
                continue
            token = sim_token(key, entry.context_len, sampling[sid].seed)
            if masks is not None and sid in masks:
                token = _allowed(masks.get(sid), token)
            tokens.append(token)
        rows = plan.num_decode_tokens + plan.num_prefill_tokens
        self.ticks += 1
        self.rows += rows
        left = self.pace.tick_s(rows) - (self.clock() - start)
        if left > 0:
            self.slept_s += left
            self.sleep(left)
        return tokens

    def recomputed(self, session_id: str) -> int:
        return 0  # the plan's block tables address the pool: a cached block is there

    def release(self, session_id: str) -> None:
        self._keys.pop(session_id, None)

    def _eos_due(self, index: int) -> bool:
        return self.eos_after is not None and self._eos is not None and index >= self.eos_after


def _allowed(mask: bytes, token: int) -> int:
    """The first token the mask allows at or after `token` (wrapping around); `token`
    when the mask allows none. Bit i of little-endian 32-bit word i // 32 is token i,
    which is bit i % 8 of byte i // 8."""
    n = 8 * len(mask)
    for i in range(n):
        t = (token + i) % n
        if mask[t >> 3] >> (t & 7) & 1:
            return t
    return token
