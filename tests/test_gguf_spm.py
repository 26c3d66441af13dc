"""GGUF SentencePiece (`tokenizer.ggml.model == "llama"`) vocabularies: parity with
transformers' GGUF loader on files written in the test.

The vocabulary is built here, offline, the way SentencePiece's BPE trainer lays one
out: `<unk>`, `<s>`, `</s>`, the 256 `<0xNN>` byte-fallback tokens, then the merged
pieces in merge order (score -rank), then the single characters; plus a few chat
control tokens, a user-defined one and an unused one. Characters the corpus lacks
(most capitals, newlines, tabs, emoji, most non-ASCII) fall back to bytes.

Where transformers (and so tokenfleet) differs from llama.cpp's own SPM tokenizer:
- the `▁` is prepended only at the very start of the text (Metaspace prepend_scheme
  "first"), not again after each special token as llama.cpp does, and not when the
  text already starts with a space (`" hi"` -> `▁hi`; llama.cpp `▁▁hi`). Phi-3 files
  get a Prepend normalizer instead, which prepends to every piece between special
  tokens, like llama.cpp;
- llama.cpp ranks pairs by the merged piece's score at run time; here the merges are
  rebuilt from the scores once, which agrees except for ties between two splits of
  the same piece;
- transformers ignores `add_space_prefix = false` (it always prepends); tokenfleet
  honours it, as llama.cpp does, so only that case is not a parity test;
- transformers leaves the BPE's unk token unset, so a character with no byte token
  would vanish; tokenfleet gives unk. Every vocabulary here has all 256 byte tokens.
"""

from __future__ import annotations

import collections
import itertools
import json
import re
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
from gguf import GGUFReader

from tests.helpers.gguf_files import add_model_metadata, finish_gguf, gguf_name
from tests.helpers.models import make_hf_llama
from tokenfleet.model import ModelLoadError, load_model
from tokenfleet.model.gguf_tokenizer import (
    SUPPORTED_TOKENIZER_MODELS,
    sentencepiece_bpe,
    tokenizer_from_gguf,
)
from tokenfleet.model.tokenizer import HFTokenizer

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
UNK, BOS, EOS = 0, 1, 2

Piece = tuple[str, float, int]  # (text, score, llama.cpp token type)

_WORDS = re.findall(
    r"\S+",
    "the quick brown fox jumps over lazy dog and then runs into forest where trees grow "
    "tall hello world token fleet serving model inference batch request response queue "
    "worker python function return value print import class self data list dict string "
    "number café naïve über The Hello A It Is",
)
_CODE = (
    "def f(x):\n    return x + 1\n",
    "for i in range(10):\n        print(i)\n",
    "if a == b:\n    pass\n",
    "class Worker(object):\n    def __init__(self):\n        self.queue = []\n",
)


def _corpus() -> str:
    rng = np.random.default_rng(1)
    out: list[str] = []
    for _ in range(400):
        words = rng.choice(_WORDS, size=int(rng.integers(3, 12)))
        out.append(" ".join(words) + str(rng.choice([".", ",", "!", "?", ""])))
        if rng.random() < 0.2:
            out.append(str(rng.choice(_CODE)))
        if rng.random() < 0.2:
            out.append(str(int(rng.integers(0, 100000))))
    return " ".join(out)


def _train_bpe(text: str, n_merges: int) -> tuple[list[str], list[str]]:
    """(merged pieces in merge order, alphabet): a small SentencePiece-style BPE
    trainer (words start at a `▁`, runs of `▁` stay together; `\\n`/`\\t` and
    characters seen fewer than 3 times are left to byte fallback)."""
    spelled = "▁" + text.replace(" ", "▁")
    counts = collections.Counter(re.findall(r"▁+[^▁\n\t]*|[^▁\n\t]+", spelled))
    chars = collections.Counter[str]()
    for word, n in counts.items():
        for c in word:
            chars[c] += n
    alphabet = sorted(c for c, n in chars.items() if n >= 3)
    known = set(alphabet)
    words = {tuple(w): n for w, n in counts.items()}
    merged: list[str] = []
    for _ in range(n_merges):
        pairs = collections.Counter[tuple[str, str]]()
        for word_syms, n in words.items():
            for a, b in itertools.pairwise(word_syms):
                if a in known and b in known:
                    pairs[a, b] += n
        if not pairs:
            break
        best = max(pairs, key=lambda p: (pairs[p], p))
        piece = best[0] + best[1]
        merged.append(piece)
        known.add(piece)
        rewritten: dict[tuple[str, ...], int] = {}
        for word_syms, n in words.items():
            out: list[str] = []
            i = 0
            while i < len(word_syms):
                if i + 1 < len(word_syms) and (word_syms[i], word_syms[i + 1]) == best:
                    out.append(piece)
                    i += 2
                else:
                    out.append(word_syms[i])
                    i += 1
            rewritten[tuple(out)] = rewritten.get(tuple(out), 0) + n
        words = rewritten
    return merged, alphabet


def spm_vocab() -> list[Piece]:
    merged, alphabet = _train_bpe(_corpus(), 400)
    pieces: list[Piece] = [("<unk>", 0.0, UNKNOWN), ("<s>", 0.0, CONTROL), ("</s>", 0.0, CONTROL)]
    pieces += [(f"<0x{b:02X}>", 0.0, BYTE) for b in range(256)]
    pieces += [(p, -float(i), NORMAL) for i, p in enumerate(merged)]
    pieces += [(c, -float(len(merged) + i), NORMAL) for i, c in enumerate(alphabet)]
    pieces += [
        ("<|im_start|>", 0.0, CONTROL),
        ("<|im_end|>", 0.0, CONTROL),
        ("<think>", 0.0, USER_DEFINED),
        ("<unused0>", 0.0, UNUSED),
    ]
    return pieces


PIECES = spm_vocab()

# Hugging Face name -> GGUF tensor name (weights only need the right names and shapes
# here: the tests read the tokenizer).
_HF_TO_GGUF = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}
_TOP = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def write_spm_gguf(
    path: Path,
    pieces: list[Piece] = PIECES,
    *,
    arch: str = "llama",
    with_model: bool = False,
    tokenizer_model: str = "llama",
    add_bos: bool | None = True,
    add_eos: bool | None = None,
    add_space_prefix: bool | None = None,
    merges: list[str] | None = None,
    scores: bool = True,
) -> Path:
    """A GGUF with a SentencePiece vocabulary (and, `with_model`, a tiny random Llama
    whose vocab is that size); a None flag is left out of the file."""
    w = gguf.GGUFWriter(str(path), arch)
    if with_model:
        hf = make_hf_llama(seed=5, vocab_size=len(pieces))
        c: Any = hf.config
        add_model_metadata(w, c)
    w.add_tokenizer_model(tokenizer_model)
    w.add_token_list([p for p, _, _ in pieces])
    if scores:
        w.add_token_scores([s for _, s, _ in pieces])
    w.add_token_types([k for _, _, k in pieces])
    if merges is not None:
        w.add_token_merges(merges)
    w.add_bos_token_id(BOS)
    w.add_eos_token_id(EOS)
    w.add_unk_token_id(UNK)
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
    if add_eos is not None:
        w.add_add_eos_token(add_eos)
    if add_space_prefix is not None:
        w.add_add_space_prefix(add_space_prefix)
    if with_model:
        for name, t in hf.state_dict().items():
            if name == "lm_head.weight" and c.tie_word_embeddings:
                continue
            w.add_tensor(gguf_name(name), np.ascontiguousarray(t.detach().float().numpy()))
    return finish_gguf(w, path)


def ours(path: Path) -> HFTokenizer:
    tok = tokenizer_from_gguf(GGUFReader(path), path)
    assert tok is not None
    return tok


def reference(path: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def spm_strings() -> list[str]:
    base = [
        "",
        " ",
        "   ",
        "\n",
        "\n\n\n",
        "\t\tindent",
        "hello world",
        " hello world",
        "  hello world",
        "hello  world",
        "hello   \n  world",
        "trailing spaces   ",
        "Hello World! The Quick Brown Fox.",
        "ALL CAPS SHOUTING",
        "the quick brown fox jumps over the lazy dog",
        "thequickbrownfox",
        "The year 2024 had 366 days; 1234567890 is a number. 3.14159",
        "naïve café résumé façade über",
        "日本語のテキストです。",
        "中文文本，标点符号！",
        "Привет, мир!",
        "مرحبا بالعالم",
        "emoji: 😀🎉👍🏽 family: 👨‍👩‍👧‍👦",
        "def f(x):\n    return x ** 2  # square\n",
        "for i in range(10):\n        print(i)\n",
        "class Worker(object):\n    def __init__(self):\n        self.queue = []\n",
        "for (int i = 0; i < n; ++i) { sum += a[i]; }",
        '{"key": [1, 2, 3], "nested": {"a": null}}',
        "<s>",
        "</s>",
        "<s>hello</s>",
        "<s> hello </s> world",
        "hello<s>world</s>",
        "text</s>more text",
        "<s><s></s></s>",
        "<s",
        "s>",
        "</s >",
        "<unk>",
        "a <unk> b",
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
        "<|im_start|><|im_end|>",
        "<|im_start|user",
        "<think>the answer</think> is 42",
        "<unused0> is a piece",
        "https://example.com/path?q=1&r=2#frag",
        "a\u00a0b\u2003c\u200bd",
        "\r\n windows\r\nline endings",
        "~!@#$%^&*()_+-=[]{}|;':\",./<>?",
        "▁ already a metaspace ▁▁",
        "<0x41> spelled like a byte token",
        "x" * 300,
        "ab " * 50,
        "the " * 40,
    ]
    words = [
        "the",
        " quick",
        "Brown",
        "fox",
        "42",
        "ü",
        "🤖",
        "\n",
        "  ",
        "_x",
        "{",
        "'s",
        "é",
        "<s>",
        "</s>",
        " serving",
        "inference",
        "    ",
        "<|im_end|>",
        "\t",
    ]
    rng = np.random.default_rng(0)
    extra = ["".join(rng.choice(words, size=int(rng.integers(1, 12)))) for _ in range(150)]
    return base + extra


STRINGS = spm_strings()


def assert_parity(tok: HFTokenizer, ref: Any, strings: list[str]) -> None:
    for s in strings:
        ids = tok.encode(s)
        assert ids == ref.encode(s), s
        assert tok.encode(s, add_special_tokens=False) == ref.encode(s, add_special_tokens=False), s
        assert tok.decode(ids) == ref.decode(ids, skip_special_tokens=True), s
        assert tok.decode(ids, skip_special_tokens=False) == ref.decode(ids), s


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("spm")


def test_vocabulary_exercises_merges_and_byte_fallback(files: Path) -> None:
    tok = ours(write_spm_gguf(files / "vocab.gguf"))
    vocab = {p: i for i, (p, _, _) in enumerate(PIECES)}
    long_pieces = [p for p, _, k in PIECES if k == NORMAL and len(p) >= 5]
    assert len(PIECES) > 600 and len(long_pieces) > 50
    # common words are whole pieces, built through several merges
    assert tok.encode("the quick brown fox", add_special_tokens=False) == [
        vocab["▁the"],
        vocab["▁quick"],
        vocab["▁brown"],
        vocab["▁fox"],
    ]
    # an emoji and a newline have no piece: their UTF-8 bytes
    ids = tok.encode("😀\n", add_special_tokens=False)
    assert ids == [vocab["▁"]] + [vocab[f"<0x{b:02X}>"] for b in "😀\n".encode()]
    assert tok.decode(ids) == "😀\n"


def test_loaded_model_tokenizer_matches_transformers(files: Path) -> None:
    path = write_spm_gguf(files / "model.gguf", with_model=True)
    loaded = load_model(str(path), device="cpu")
    assert loaded.config.bos_token_id == BOS and loaded.config.eos_token_ids == (EOS,)
    tok = loaded.tokenizer
    assert isinstance(tok, HFTokenizer)
    assert tok.vocab_size == len(PIECES)
    assert tok.bos_token_id == BOS and tok.eos_token_ids == (EOS,)
    assert len(STRINGS) >= 200
    assert_parity(tok, reference(path), STRINGS)


@pytest.mark.parametrize(
    ("name", "kwargs"),
    [
        ("no-bos-flag", dict(add_bos=None)),  # llama.cpp and transformers default: add BOS
        ("no-bos", dict(add_bos=False)),
        ("bos-eos", dict(add_bos=True, add_eos=True)),
        ("space-prefix", dict(add_space_prefix=True)),
        ("phi3", dict(arch="phi3")),  # the prefix `▁` from a normalizer
    ],
)
def test_variants_match_transformers(files: Path, name: str, kwargs: dict[str, Any]) -> None:
    path = write_spm_gguf(files / f"{name}.gguf", **kwargs)
    assert_parity(ours(path), reference(path), STRINGS)


def test_merges_in_the_file_win_over_scores(files: Path) -> None:
    # A file that lists merges: both use them, whatever the scores say. Here: the
    # merges the scores give, reversed, less the one that makes "▁quick".
    derived = sentencepiece_bpe(
        [p for p, _, _ in PIECES], [s for _, s, _ in PIECES], token_types=[]
    ).to_str()
    pairs = json.loads(derived)["model"]["merges"]
    merges = [" ".join(pair) for pair in pairs[::-1] if "".join(pair) != "▁quick"]
    path = write_spm_gguf(files / "merges.gguf", merges=merges, scores=False)
    tok = ours(path)
    quick = [p for p, _, _ in PIECES].index("▁quick")
    assert quick in ours(write_spm_gguf(files / "scored.gguf")).encode("the quick fox")
    assert quick not in tok.encode("the quick fox")
    assert_parity(tok, reference(path), STRINGS)


def test_bos_is_prepended_only_when_asked(files: Path) -> None:
    text = "hello world"
    body = ours(write_spm_gguf(files / "b0.gguf", add_bos=False)).encode(text)
    assert BOS not in body
    for add_bos in (True, None):  # None: the flag is absent, BOS is the default
        tok = ours(write_spm_gguf(files / f"b-{add_bos}.gguf", add_bos=add_bos))
        assert tok.encode(text) == [BOS, *body]
        assert tok.encode(text, add_special_tokens=False) == body
        assert tok.bos_token_id == BOS
    tok = ours(write_spm_gguf(files / "b-eos.gguf", add_bos=False, add_eos=True))
    assert tok.encode(text) == [*body, EOS]
    assert tok.decode(tok.encode(text)) == text


def test_add_space_prefix_false_is_honoured(files: Path) -> None:
    # transformers' GGUF loader ignores this flag (it still prepends `▁` and strips it
    # on decode); llama.cpp and tokenfleet do not prepend.
    vocab = {p: i for i, (p, _, _) in enumerate(PIECES)}
    tok = ours(write_spm_gguf(files / "nospace.gguf", add_bos=False, add_space_prefix=False))
    with_prefix = ours(write_spm_gguf(files / "space.gguf", add_bos=False))
    assert tok.encode("fox jumps") == [vocab["f"], vocab["o"], vocab["x"], vocab["▁jumps"]]
    assert with_prefix.encode("fox jumps") == [vocab["▁fox"], vocab["▁jumps"]]
    for s in ("fox jumps", " the fox", "😀 x\n", "  two spaces", "<s>a</s> b"):
        assert tok.decode(tok.encode(s), skip_special_tokens=False) == s


def test_unknown_tokenizer_model_is_named(files: Path) -> None:
    path = write_spm_gguf(files / "bert.gguf", tokenizer_model="bert")
    assert SUPPORTED_TOKENIZER_MODELS == ("gpt2", "llama")
    with pytest.raises(
        ModelLoadError,
        match=r"tokenizer model 'bert' not supported; supported: \['gpt2', 'llama'\]",
    ):
        ours(path)


def test_llama_vocabulary_without_scores_or_merges_is_named(files: Path) -> None:
    path = write_spm_gguf(files / "noscores.gguf", scores=False)
    with pytest.raises(
        ModelLoadError, match=r"needs tokenizer.ggml.tokens and tokenizer.ggml.scores"
    ):
        ours(path)
