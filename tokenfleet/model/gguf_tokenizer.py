"""Rebuild a `tokenizers.Tokenizer` from a GGUF file's `tokenizer.ggml.*` metadata.

A GGUF carries no `tokenizer.json`: only the vocabulary, the merges, each token's
type, the special ids and a `pre` name for the pre-tokenizer split. This follows
what transformers' GGUF loader does (transformers/integrations/gguf/
gguf_tokenizer_mapping.py), so both read a file the same way. Two vocabularies are
supported: byte-level BPE (`tokenizer.ggml.model == "gpt2"`) and SentencePiece-style
BPE with byte fallback (`"llama"`: Llama 1/2, Mistral, Phi-3 and the like), whose
merges are rebuilt from the piece scores when the file lists none.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache
from pathlib import Path
from typing import Any

from gguf import GGUFReader
from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as _RustTokenizer
from tokenizers.models import BPE

from tokenfleet.errors import ModelLoadError
from tokenfleet.model.gguf_fields import field_value
from tokenfleet.model.tokenizer import HFTokenizer

SUPPORTED_TOKENIZER_MODELS = ("gpt2", "llama")

# llama.cpp token types (llama_token_type): 1 normal, 2 unknown, 3 control,
# 4 user-defined, 5 unused, 6 byte (`<0x0A>`, SentencePiece's byte fallback).
_CONTROL = 3
_USER_DEFINED = 4

_SPACE = "\u2581"  # "▁", SentencePiece's spelling of a space
# Architectures whose SentencePiece vocabulary gets its prefix space from a normalizer
# rather than from the Metaspace pre-tokenizer (transformers' phi3_tokenizer).
_NORMALIZER_PREFIX_ARCHITECTURES = frozenset({"phi3"})

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
            "ggml.scores",
            "ggml.token_type",
            "ggml.merges",
            "ggml.bos_token_id",
            "ggml.eos_token_id",
            "ggml.unknown_token_id",
            "ggml.padding_token_id",
            "ggml.add_bos_token",
            "ggml.add_eos_token",
            "ggml.add_space_prefix",
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
    bos, eos = meta["ggml.bos_token_id"], meta["ggml.eos_token_id"]
    if model == "llama":
        tok = _sentencepiece_from_meta(meta, reader, file)
    else:
        tokens, merges = meta["ggml.tokens"], meta["ggml.merges"]
        if not isinstance(tokens, list) or not isinstance(merges, list):
            raise ModelLoadError(
                f"{file.name}: a gpt2 tokenizer needs tokenizer.ggml.tokens and "
                "tokenizer.ggml.merges"
            )
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


def _sentencepiece_from_meta(
    meta: dict[str, Any], reader: GGUFReader, file: Path
) -> _RustTokenizer:
    tokens, scores, merges = meta["ggml.tokens"], meta["ggml.scores"], meta["ggml.merges"]
    if not isinstance(tokens, list) or not (isinstance(scores, list) or isinstance(merges, list)):
        raise ModelLoadError(
            f"{file.name}: a llama tokenizer needs tokenizer.ggml.tokens and "
            "tokenizer.ggml.scores (or tokenizer.ggml.merges)"
        )
    if isinstance(scores, list) and len(scores) != len(tokens):
        raise ModelLoadError(
            f"{file.name}: {len(tokens)} tokens but {len(scores)} scores in tokenizer.ggml.*"
        )
    n = len(tokens)

    def token_id(key: str) -> int | None:
        value = meta[key]
        if value is None:
            return None
        if not 0 <= int(value) < n:
            raise ModelLoadError(f"{file.name}: tokenizer.{key} {value} is not a token id (< {n})")
        return int(value)

    bos, eos = token_id("ggml.bos_token_id"), token_id("ggml.eos_token_id")
    unk, pad = token_id("ggml.unknown_token_id"), token_id("ggml.padding_token_id")
    # llama.cpp adds BOS to a SentencePiece vocabulary that does not say otherwise, and
    # so does transformers; EOS only when asked.
    add_bos = meta["ggml.add_bos_token"]
    arch = field_value(reader, "general.architecture")
    return sentencepiece_bpe(
        tokens,
        scores if isinstance(scores, list) else None,
        token_types=meta["ggml.token_type"] or [],
        merges=meta["ggml.merges"] if isinstance(merges, list) else None,
        unk_token_id=unk,
        special_token_ids=[i for i in (unk, bos, eos, pad) if i is not None],
        bos_token_id=bos if add_bos is None or add_bos else None,
        eos_token_id=eos if meta["ggml.add_eos_token"] else None,
        add_space_prefix=meta["ggml.add_space_prefix"] in (None, True),
        prefix_by_normalizer=arch in _NORMALIZER_PREFIX_ARCHITECTURES,
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


def sentencepiece_bpe(
    tokens: list[str],
    scores: list[float] | None,
    *,
    token_types: list[int],
    merges: list[str] | None = None,
    unk_token_id: int | None = None,
    special_token_ids: Sequence[int] = (),
    bos_token_id: int | None = None,
    eos_token_id: int | None = None,
    add_space_prefix: bool = True,
    prefix_by_normalizer: bool = False,
) -> _RustTokenizer:
    """A SentencePiece-style BPE over `▁`-spelled pieces, falling back to `<0xNN>`
    byte tokens for characters it lacks (transformers' LlamaTokenizer, as its GGUF
    loader builds it).

    `merges` are used as given; without them they are rebuilt from `scores` (a piece's
    splits into two pieces, best score first). `special_token_ids` (the file's unk,
    bos, eos, pad) are kept whole and special besides the control tokens. A set
    `bos_token_id`/`eos_token_id` means encode prepends/appends it. `add_space_prefix`
    puts a `▁` before the text (and decode strips one leading space);
    `prefix_by_normalizer` does that with a normalizer instead of the Metaspace
    pre-tokenizer, as transformers does for Phi-3.

    Where this (and transformers) differs from llama.cpp's own SPM tokenizer:
    - Metaspace with prepend_scheme "first" adds the `▁` only at the very start of the
      text, not after each special token as llama.cpp does (`"<s>hi"` gives `hi`, not
      `▁hi`), and not when the text already starts with a space (`" hi"` gives `▁hi`,
      llama.cpp `▁▁hi`). The Phi-3 normalizer form prepends to every piece of text
      between special tokens, so it has neither difference.
    - A file's `add_space_prefix = false` is honoured here (no `▁`, no strip on decode),
      as llama.cpp does; transformers' GGUF loader ignores the flag and always prepends.
    - The BPE's unk token is set, so a character with no byte token encodes as unk (as
      llama.cpp does); transformers leaves it unset and silently drops the character.
      Vocabularies with all 256 byte tokens never reach this.
    """
    vocab = {t: i for i, t in enumerate(tokens)}
    if merges is not None:
        pairs = [_merge_pair(m) for m in merges]
    elif scores is not None:
        pairs = _merges_from_scores(tokens, scores, vocab)
    else:
        raise ModelLoadError("a SentencePiece BPE needs piece scores or merges")
    unk = None if unk_token_id is None else tokens[unk_token_id]
    tok = _RustTokenizer(
        BPE(
            vocab=vocab,
            merges=pairs,
            dropout=None,
            unk_token=unk,
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    if prefix_by_normalizer:
        steps: list[normalizers.Normalizer] = [normalizers.Replace(" ", _SPACE)]
        if add_space_prefix:
            steps.insert(0, normalizers.Prepend(_SPACE))
        tok.normalizer = normalizers.Sequence(steps)
    else:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(
            replacement=_SPACE,
            prepend_scheme="first" if add_space_prefix else "never",
            split=False,
        )
    steps_out: list[decoders.Decoder] = [
        decoders.Replace(_SPACE, " "),
        decoders.ByteFallback(),
        decoders.Fuse(),
    ]
    if add_space_prefix:
        steps_out.append(decoders.Strip(content=" ", left=1, right=0))
    tok.decoder = decoders.Sequence(steps_out)
    # Control tokens, and the named unk/bos/eos/pad, stay whole and are special
    # (skipped on decode); user-defined ones are whole but not special. Both are
    # matched on the raw text, before the `▁` rewrite.
    kinds = list(zip(tokens, token_types, strict=False))
    special = dict.fromkeys(t for t, k in kinds if k == _CONTROL)
    special.update(dict.fromkeys(tokens[i] for i in special_token_ids))
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in special])
    user = [t for t, k in kinds if k == _USER_DEFINED]
    if user:
        tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])
    tok.post_processor = _bos_eos_template(tokens, bos_token_id, eos_token_id)
    return tok


def _merges_from_scores(
    tokens: list[str], scores: list[float], vocab: dict[str, int]
) -> list[tuple[str, str]]:
    """Each piece's splits into two pieces of the vocabulary, best-scored piece first,
    a piece's splits longer left half first, equal scores in vocabulary order: the
    order of transformers' generate_merges, so ties fall the same way."""
    ranked: list[tuple[str, str, float]] = []
    for piece, score in dict(zip(tokens, scores, strict=True)).items():
        local = [
            (piece[:i], piece[i:], float(score))
            for i in range(1, len(piece))
            if piece[:i] in vocab and piece[i:] in vocab
        ]
        local.sort(key=lambda m: (vocab[m[0]], vocab[m[1]]))
        ranked.extend(local)
    ranked.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in ranked]


def _bos_eos_template(
    tokens: list[str], bos_token_id: int | None, eos_token_id: int | None
) -> processors.TemplateProcessing:
    bos = [] if bos_token_id is None else [tokens[bos_token_id]]
    eos = [] if eos_token_id is None else [tokens[eos_token_id]]
    single = [f"{t}:0" for t in bos] + ["$A:0"] + [f"{t}:0" for t in eos]
    pair = single + [f"{t}:1" for t in bos] + ["$B:1"] + [f"{t}:1" for t in eos]
    specials = [(tokens[i], i) for i in (bos_token_id, eos_token_id) if i is not None]
    return processors.TemplateProcessing(
        single=" ".join(single), pair=" ".join(pair), special_tokens=specials
    )


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
