"""Rebuild a `tokenizers.Tokenizer` from a GGUF file's `tokenizer.ggml.*` metadata.

A GGUF carries no `tokenizer.json`: only the vocabulary, the merges, each token's
type, the special ids and a `pre` name for the pre-tokenizer split. This follows
what transformers' GGUF loader does (transformers/integrations/gguf/
gguf_tokenizer_mapping.py), so both read a file the same way. Only byte-level BPE
(`tokenizer.ggml.model == "gpt2"`) is supported so far.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

from gguf import GGUFReader
from tokenizers import AddedToken, Regex, decoders, pre_tokenizers, processors
from tokenizers import Tokenizer as _RustTokenizer
from tokenizers.models import BPE

from tokenfleet.model.errors import ModelLoadError
from tokenfleet.model.gguf_fields import field_value
from tokenfleet.model.tokenizer import HFTokenizer

SUPPORTED_TOKENIZER_MODELS = ("gpt2",)

# llama.cpp token types (llama_token_type)
_CONTROL = 3
_USER_DEFINED = 4

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# `tokenizer.ggml.pre` -> split regex (transformers' GGUF_PRE_TOKENIZER_SPLITS, the
# families we can run). Any other value, e.g. SmolLM2's "smollm", gets GPT-2's
# ByteLevel split, as transformers' GPT2Tokenizer does.
PRE_TOKENIZER_SPLITS = {
    **dict.fromkeys(
        ("llama3", "llama-v3", "llama-bpe", "falcon3", "smaug-bpe", "dbrx"), _LLAMA3_SPLIT
    ),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen"), _QWEN2_SPLIT),
    **dict.fromkeys(("gpt-4o", "llama4"), _GPT4O_SPLIT),
}


def tokenizer_from_gguf(reader: GGUFReader, file: Path) -> HFTokenizer | None:
    """The file's tokenizer, with its bos/eos ids and chat template (None when the
    file has no `tokenizer.ggml.model`)."""
    meta = {
        key: field_value(reader, f"tokenizer.{key}")
        for key in (
            "ggml.model",
            "ggml.pre",
            "ggml.tokens",
            "ggml.token_type",
            "ggml.merges",
            "ggml.bos_token_id",
            "ggml.eos_token_id",
            "ggml.add_bos_token",
            "chat_template",
        )
    }
    model = meta["ggml.model"]
    if model is None:
        return None
    if model not in SUPPORTED_TOKENIZER_MODELS:
        raise ModelLoadError(
            f"{file.name}: tokenizer model {model!r} not supported; "
            f"supported: {list(SUPPORTED_TOKENIZER_MODELS)}"
        )
    tokens, merges = meta["ggml.tokens"], meta["ggml.merges"]
    if not isinstance(tokens, list) or not isinstance(merges, list):
        raise ModelLoadError(
            f"{file.name}: a gpt2 tokenizer needs tokenizer.ggml.tokens and tokenizer.ggml.merges"
        )
    bos, eos = meta["ggml.bos_token_id"], meta["ggml.eos_token_id"]
    tok = byte_level_bpe(
        tokens,
        merges,
        token_types=meta["ggml.token_type"] or [],
        pre=meta["ggml.pre"],
        bos_token_id=bos if meta["ggml.add_bos_token"] else None,
    )
    template = meta["chat_template"]
    return HFTokenizer(
        tok,
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=() if eos is None else (int(eos),),
        chat_template=template if isinstance(template, str) else None,
    )


def byte_level_bpe(
    tokens: list[str],
    merges: list[str],
    *,
    token_types: list[int],
    pre: str | None,
    bos_token_id: int | None = None,
) -> _RustTokenizer:
    """A GPT-2 style byte-level BPE; `bos_token_id` set means encode prepends it."""
    alphabet = _byte_alphabet()
    spelling = _byte_spelling()
    # Tokens outside the byte alphabet (rare mislabels) are respelled byte by byte.
    vocab = {
        t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8")): i
        for i, t in enumerate(tokens)
    }
    pairs = [_merge_pair(m) for m in merges]
    tok = _RustTokenizer(
        BPE(
            vocab=vocab,
            merges=pairs,
            dropout=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
        )
    )
    split = PRE_TOKENIZER_SPLITS.get(pre or "")
    if split is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    tok.decoder = decoders.ByteLevel()
    # Control tokens stay whole and are special (skipped on decode); one spelled
    # outside the byte alphabet is a llama.cpp mislabel and is left out, as
    # transformers does. User-defined ones (like `<think>`) are whole but not special.
    kinds = list(zip(tokens, token_types, strict=False))
    control = [t for t, k in kinds if k == _CONTROL and set(t) <= alphabet]
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in control])
    user = [t for t, k in kinds if k == _USER_DEFINED and t in vocab]
    if user:
        tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])
    if bos_token_id is not None:
        bos = tokens[bos_token_id]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos}:0 $A:0",
            pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
            special_tokens=[(bos, bos_token_id)],
        )
    return tok


def _merge_pair(merge: Any) -> tuple[str, str]:
    left, sep, right = str(merge).partition(" ")
    if not sep:
        raise ModelLoadError(f"malformed BPE merge {merge!r} (expected 'a b')")
    return left, right


@cache
def _byte_spelling() -> dict[int, str]:
    """GPT-2's byte -> printable character table (bytes_to_unicode)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    spelled = {b: chr(b) for b in printable}
    n = 0
    for b in range(256):
        if b not in spelled:
            spelled[b] = chr(256 + n)
            n += 1
    return spelled


@cache
def _byte_alphabet() -> frozenset[str]:
    return frozenset(_byte_spelling().values())
