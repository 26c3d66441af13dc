"""Structured output: a job's grammar (JSON schema, any JSON object, a regex or a Lark
grammar) enforced while it decodes, with llguidance.

Why llguidance (xgrammar and outlines-core are on PyPI too): it compiles JSON schema,
regex and Lark itself, it builds its token masks lazily from the grammar instead of an
index precomputed per vocabulary up front, its wheel declares no dependencies (no
torch, no compiler), and its mask computation drops the GIL, so a tick computes the
masks of its structured sessions on a thread while the forward pass runs (`MaskJobs`).
Measured here: a schema on every session costs about 4 % of useful tok/s
(docs/benchmarks.md, "Structured output"). A session without a grammar never touches
it. xgrammar and outlines-core were not measured side by side.

Per session: one `LLMatcher`; every emitted token (resumed ones too) is consumed into
it, so its state always follows the session's output; its mask is applied to that
session's logits row before sampling (`TorchRunner.execute`). A grammar that cannot
compile is the job's `rejected_invalid`, with llguidance's message.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from tokenfleet.model.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer
from tokenfleet.protocol import Structured

if TYPE_CHECKING:
    from llguidance import LLMatcher, LLTokenizer


class GrammarError(ValueError):
    """The job's grammar cannot be compiled (or the model has no tokenizer for it)."""


def _llg_tokenizer(tokenizer: Tokenizer, vocab_size: int) -> LLTokenizer:
    from llguidance import LLTokenizer, TokenizerWrapper

    if isinstance(tokenizer, HFTokenizer):
        return LLTokenizer(
            tokenizer.to_json(), n_vocab=vocab_size, eos_token=list(tokenizer.eos_token_ids)
        )
    if isinstance(tokenizer, ByteTokenizer):

        class _Bytes:
            """What llguidance's TokenizerWrapper reads: each id's bytes, encode."""

            def __init__(self, byte_tok: ByteTokenizer) -> None:
                self.eos_token_id = byte_tok.eos_token_ids[0]
                self.bos_token_id = byte_tok.bos_token_id
                num = ByteTokenizer.NUM_BYTES
                self.tokens = [bytes([i]) if i < num else b"" for i in range(vocab_size)]
                self.special_token_ids = list(range(num, vocab_size))

            def __call__(self, text: bytes) -> list[int]:
                return list(text)

        return LLTokenizer(TokenizerWrapper(_Bytes(tokenizer)), n_vocab=vocab_size)
    raise GrammarError(f"structured output needs a byte-level or HF tokenizer, not {tokenizer!r}")


def grammar_text(spec: Structured) -> str:
    """llguidance's grammar for the job's `structured` field (raises GrammarError)."""
    from llguidance import LLMatcher

    # compact JSON: no whitespace between tokens beyond what JSON requires
    options: Any = {"whitespace_flexible": False}
    try:
        if spec.kind == "json_object":
            return LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=options)
        if spec.kind == "json_schema":
            schema = json.loads(spec.value or "")
            if not isinstance(schema, dict):
                raise GrammarError("a JSON schema must be a JSON object")
            return LLMatcher.grammar_from_json_schema(schema, overrides=options)
        if spec.kind == "regex":
            return LLMatcher.grammar_from_regex(spec.value or "")
        return LLMatcher.grammar_from_lark(spec.value or "")
    except ValueError as exc:  # json.JSONDecodeError is one, and llguidance's own
        raise GrammarError(f"invalid {spec.kind}: {exc}") from None


class Grammars:
    """One engine's grammar support: the llguidance tokenizer (built on first use, about
    a second for a 50k vocabulary) and a small cache of compiled grammar texts."""

    def __init__(self, tokenizer: Tokenizer | None, vocab_size: int) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._llg: LLTokenizer | None = None
        self._texts: dict[tuple[str, str | None], str] = {}

    def matcher(self, spec: Structured) -> LLMatcher:
        """A fresh matcher for one session (raises GrammarError)."""
        from llguidance import LLMatcher

        if self._tokenizer is None:
            raise GrammarError("this model has no tokenizer: structured output needs one")
        if self._llg is None:
            self._llg = _llg_tokenizer(self._tokenizer, self._vocab_size)
        key = (spec.kind, spec.value)
        text = self._texts.get(key)
        if text is None:
            text = grammar_text(spec)
            if len(self._texts) > 256:
                self._texts.clear()
            self._texts[key] = text
        matcher = LLMatcher(self._llg, text, log_level=0)
        if matcher.is_error():
            raise GrammarError(f"invalid {spec.kind}: {matcher.get_error()}")
        return matcher


class MaskJobs:
    """The token masks of one tick's structured sessions, computed on a worker thread
    (llguidance drops the GIL) while the forward pass runs; `.get(sid)` waits for one."""

    _pool: ThreadPoolExecutor | None = None

    def __init__(self, matchers: Mapping[str, LLMatcher]) -> None:
        if MaskJobs._pool is None:
            MaskJobs._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar")
        pool = MaskJobs._pool
        self._futures: dict[str, Future[bytes]] = {
            sid: pool.submit(m.compute_bitmask) for sid, m in matchers.items()
        }

    def __contains__(self, sid: object) -> bool:
        return sid in self._futures

    def __bool__(self) -> bool:
        return bool(self._futures)

    def get(self, sid: str) -> bytes:
        return self._futures[sid].result()

    def settle(self) -> None:
        """Wait for every mask (a forward that failed left some running): a matcher is
        never touched by two threads at once."""
        for future in self._futures.values():
            future.exception()


__all__ = ["GrammarError", "Grammars", "MaskJobs", "grammar_text"]
