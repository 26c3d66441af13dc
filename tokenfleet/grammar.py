"""Structured output: a job's grammar (JSON schema, any JSON object, a regex or a Lark
grammar) enforced while it decodes, with llguidance.

Why llguidance (xgrammar and outlines-core are on PyPI too): it compiles JSON schema,
regex and Lark itself, it builds its token masks lazily from the grammar instead of an
index precomputed per vocabulary up front, its wheel declares no dependencies (no
torch, no compiler), and its mask computation drops the GIL, so a tick computes the
masks of its structured sessions on a thread while the forward pass runs (`MaskJobs`).
Measured here: a schema on every session costs about 4 % of useful tok/s
(docs/benchmarks-history.md, "Structured output"). A session without a grammar never touches
it. xgrammar and outlines-core were not measured side by side.

Per session: one `LLMatcher`; every emitted token (resumed ones too) is consumed into
it, so its state always follows the session's output; its mask is applied to that
session's logits row before sampling (`TorchRunner.execute`).

What a grammar must pass before any token (`check`, run by the gateway before submit
and by the worker before it starts the job, where a failure is `rejected_invalid`):
it compiles (the library's message), a JSON schema nests at most `MAX_SCHEMA_DEPTH`
levels, and it allows some finite output, as far as a bounded search of its states
can tell (`_probe`: a schema whose every instance must contain another, or a `$ref`
to itself, allows none). A job whose output ends any other way than satisfying its
grammar (a stop string or stop token inside the structure, the library giving up
mid-way) never ends as `stop`: it is `rejected`, `error.reason` one of `GrammarEnd`
(`unmet`); a `length` stop inside the structure stays `length`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from enum import StrEnum
from functools import cache, lru_cache
from typing import TYPE_CHECKING, Any

from tokenfleet.model.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer
from tokenfleet.protocol import ErrorInfo, Structured

if TYPE_CHECKING:
    from llguidance import LLMatcher, LLTokenizer

# Objects and arrays inside each other in a JSON schema: llguidance reads its grammar
# with serde_json, whose recursion limit (128) leaves 124 levels for the schema
# (measured with llguidance 1.9; tests/test_structured.py checks the library still
# agrees). Deeper is refused naming this, not the library's column in its own text.
MAX_SCHEMA_DEPTH = 124
# The probe for "allows some finite output": at most this many bytes consumed over all
# the branches it follows, and no state with more choices than PROBE_BRANCHES followed
# (such a grammar is too open to search: it is taken to allow output).
PROBE_BYTES = 256
PROBE_BRANCHES = 4
# ... nor for longer than this (a grammar whose every mask costs the library's whole
# step budget must not hold the gateway's event loop or a worker's tick for seconds)
PROBE_S = 0.2
_MESSAGE_CHARS = 1000  # of the library's own message (it may quote the whole grammar)
_DEAD_END = "NoExtensionBias"  # the library's error where nothing at all may follow


class GrammarError(ValueError):
    """The job's grammar cannot be used: it does not compile, nests too deep, allows no
    finite output (or the model has no tokenizer for it)."""


class GrammarEnd(StrEnum):
    """`error.reason` of a structured job that ended `rejected` after it began: its
    output does not satisfy its grammar. Stable strings, like `reasons.py`'s."""

    # the generation ended (a stop string, a stop token id) before the grammar was done
    UNSATISFIED = "grammar_unsatisfied"
    # the grammar library gave up on the grammar mid-generation (one of its limits)
    FAILED = "grammar_failed"


def _llg_tokenizer(tokenizer: Tokenizer, vocab_size: int) -> LLTokenizer:
    from llguidance import LLTokenizer

    if isinstance(tokenizer, HFTokenizer):
        return LLTokenizer(
            tokenizer.to_json(), n_vocab=vocab_size, eos_token=list(tokenizer.eos_token_ids)
        )
    if isinstance(tokenizer, ByteTokenizer):
        return _bytes_tokenizer(tokenizer.eos_token_ids[0], tokenizer.bos_token_id, vocab_size)
    raise GrammarError(f"structured output needs a byte-level or HF tokenizer, not {tokenizer!r}")


def _bytes_tokenizer(eos: int, bos: int | None, vocab_size: int) -> LLTokenizer:
    """llguidance's tokenizer for ids 0..255 = those bytes, the rest special."""
    from llguidance import LLTokenizer, TokenizerWrapper

    num = ByteTokenizer.NUM_BYTES

    class _Bytes:
        """What llguidance's TokenizerWrapper reads: each id's bytes, encode."""

        def __init__(self) -> None:
            self.eos_token_id = eos
            self.bos_token_id = bos
            self.tokens = [bytes([i]) if i < num else b"" for i in range(vocab_size)]
            self.special_token_ids = list(range(num, vocab_size))

        def __call__(self, text: bytes) -> list[int]:
            return list(text)

    return LLTokenizer(TokenizerWrapper(_Bytes()), n_vocab=vocab_size)


@cache
def _probe_tokenizer() -> LLTokenizer:
    """The byte-level tokenizer checks run on (no model needed): 256 bytes and an EOS."""
    return _bytes_tokenizer(ByteTokenizer.NUM_BYTES, None, ByteTokenizer.NUM_BYTES + 1)


def _depth(value: Any) -> int:
    """How many objects and arrays `value` nests inside each other (iteratively: a
    value deep enough to matter would run Python's recursion out)."""
    deepest = 0
    todo: list[tuple[Any, int]] = [(value, 0)]
    while todo:
        item, depth = todo.pop()
        if isinstance(item, dict | list):
            depth += 1
            deepest = max(deepest, depth)
            todo.extend((v, depth) for v in (item.values() if isinstance(item, dict) else item))
    return deepest


def _said(message: str) -> str:
    """The library's message without the parser state it appends, cut short."""
    text = message.split("\n<state>", 1)[0].strip()
    return text if len(text) <= _MESSAGE_CHARS else text[:_MESSAGE_CHARS] + " …"


def grammar_text(spec: Structured) -> str:
    """llguidance's grammar for the job's `structured` field (raises GrammarError); it
    is not yet known to compile (`check` is)."""
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
            depth = _depth(schema)
            if depth > MAX_SCHEMA_DEPTH:
                raise GrammarError(
                    f"the JSON schema nests {depth} levels deep (objects and arrays inside "
                    f"each other); structured output reads at most MAX_SCHEMA_DEPTH="
                    f"{MAX_SCHEMA_DEPTH}"
                )
            return LLMatcher.grammar_from_json_schema(schema, overrides=options)
        if spec.kind == "regex":
            return LLMatcher.grammar_from_regex(spec.value or "")
        return LLMatcher.grammar_from_lark(spec.value or "")
    except GrammarError:
        raise
    except RecursionError:  # json.loads on arrays nested thousands deep
        raise GrammarError(
            f"invalid {spec.kind}: it nests deeper than MAX_SCHEMA_DEPTH={MAX_SCHEMA_DEPTH} "
            "levels (objects and arrays inside each other)"
        ) from None
    except ValueError as exc:  # json.JSONDecodeError is one, and llguidance's own
        raise GrammarError(f"invalid {spec.kind}: {_said(str(exc))}") from None


def check(spec: Structured) -> str:
    """The grammar text of `spec`, once it compiles and allows some finite output as far
    as the library can tell; else GrammarError naming the problem. Needs no model (the
    checks run on a byte-level tokenizer), so the gateway runs it before submit."""
    return _checked(spec.kind, spec.value)


@lru_cache(maxsize=256)
def _checked(kind: str, value: str | None) -> str:
    from llguidance import LLMatcher

    spec = Structured.model_construct(kind=kind, value=value)
    text = grammar_text(spec)
    matcher = LLMatcher(_probe_tokenizer(), text, log_level=0)
    if matcher.is_error():
        raise GrammarError(f"invalid {kind}: {_said(matcher.get_error())}")
    problem = _probe(matcher)
    if problem is not None:
        raise GrammarError(f"the {_NAMES[kind]} {problem}{_HINTS.get(kind, '')}")
    return text


_NAMES = {
    "json_object": "JSON object",
    "json_schema": "JSON schema",
    "regex": "regex",
    "lark": "Lark grammar",
}
_HINTS = {
    "json_schema": ": a JSON schema has no finite instance when every value of it must "
    "contain another (a required property, or items with minItems >= 1, whose schema "
    'refers back to an enclosing one through "$ref"), or when it is only a "$ref" to itself',
    "lark": ": a rule with no alternative that ends allows no finite text",
}


def _probe(root: LLMatcher) -> str | None:
    """Search the grammar's states byte by byte for an output it accepts: None when one
    is found, or the grammar is too open to search (more than PROBE_BRANCHES choices
    somewhere, PROBE_BYTES consumed or PROBE_S spent); else what every path ran into.
    Only a search that followed every path says no, so a grammar that allows output is
    never refused."""
    stack = [root]
    budget = PROBE_BYTES
    give_up_at = time.monotonic() + PROBE_S
    gave_up: str | None = None  # the library's error on some path
    while stack:
        matcher = stack.pop()
        bits = int.from_bytes(matcher.compute_bitmask(), "little")
        if matcher.is_accepting():
            return None
        if matcher.is_error():
            said = _said(matcher.get_error())
            if said != _DEAD_END:
                gave_up = gave_up or said
            continue
        choices = [b for b in range(ByteTokenizer.NUM_BYTES) if bits >> b & 1]
        if len(choices) > min(PROBE_BRANCHES, budget) or time.monotonic() > give_up_at:
            return None
        budget -= len(choices)
        for i, byte in enumerate(choices):
            branch = matcher if i == len(choices) - 1 else matcher.deep_copy()
            if branch.consume_token(byte):
                stack.append(branch)
            else:
                gave_up = gave_up or _said(branch.get_error())
    if gave_up is not None:
        return f"allows no output the grammar library can finish (it stopped at: {gave_up})"
    return "allows no output at all"


def unmet(matcher: LLMatcher, spec: Structured, why: str, cut: str | None) -> ErrorInfo | None:
    """Why a structured job's output, ending now as it would as `stop`, does not satisfy
    its grammar (None: it does). `why` says what ended it; `cut`: the output's text when
    a stop string cut it short (the matcher has read past the cut, so the text itself is
    checked); None: the matcher has read exactly the output."""
    if matcher.is_error():
        return grammar_failed(matcher)
    done = matcher.is_accepting() if cut is None else _accepts(check(spec), cut)
    if done:
        return None
    return ErrorInfo(
        reason=GrammarEnd.UNSATISFIED,
        message=f"the output ended at {why} before it satisfied the job's {_NAMES[spec.kind]} "
        "(its text is incomplete)",
    )


def grammar_failed(matcher: LLMatcher) -> ErrorInfo:
    """The library gave up on the job's grammar (or refused a token) mid-generation."""
    said = _said(matcher.get_error()) or "no reason given"
    message = f"the grammar library gave up on the job's grammar: {said}"
    return ErrorInfo(reason=GrammarEnd.FAILED, message=message)


def _accepts(text: str, output: str) -> bool:
    """Whether grammar `text` accepts `output` whole (byte by byte, on its own matcher)."""
    from llguidance import LLMatcher

    matcher = LLMatcher(_probe_tokenizer(), text, log_level=0)
    return all(matcher.consume_token(b) for b in output.encode()) and matcher.is_accepting()


class Grammars:
    """One engine's grammar support: the llguidance tokenizer of its model (built on
    first use, about a second for a 50k vocabulary); grammar texts come from `check`
    (cached)."""

    def __init__(self, tokenizer: Tokenizer | None, vocab_size: int) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._llg: LLTokenizer | None = None

    def matcher(self, spec: Structured) -> LLMatcher:
        """A fresh matcher for one session (raises GrammarError)."""
        from llguidance import LLMatcher

        if self._tokenizer is None:
            raise GrammarError("this model has no tokenizer: structured output needs one")
        if self._llg is None:
            self._llg = _llg_tokenizer(self._tokenizer, self._vocab_size)
        matcher = LLMatcher(self._llg, check(spec), log_level=0)
        if matcher.is_error():
            raise GrammarError(f"invalid {spec.kind}: {_said(matcher.get_error())}")
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


__all__ = [
    "MAX_SCHEMA_DEPTH",
    "GrammarEnd",
    "GrammarError",
    "Grammars",
    "MaskJobs",
    "check",
    "grammar_failed",
    "grammar_text",
    "unmet",
]
