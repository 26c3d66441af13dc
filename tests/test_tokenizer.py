"""Tokenizers and the incremental detokenizer (UTF-8 safe streaming of text deltas)."""

from __future__ import annotations

import json
import tempfile
from functools import cache
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as RawTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from tokenfleet.model import ByteTokenizer, HFTokenizer, IncrementalDetokenizer, ModelLoadError
from tokenfleet.model.tokenizer import Tokenizer

CORPUS = [
    "Hello world, the fleet decodes tokens.",
    "你好，世界。多字节字符需要小心处理。",
    "Emoji: 🚀🔥👍🏽 and flags 🇫🇷 mixed with ASCII text.",
    "Ünïcödé àccents, naïve café, smörgåsbord.",
] * 20


def _byte_level_bpe(tmp_path: Path) -> HFTokenizer:
    """A small GPT-2 style byte-level BPE: multi-byte characters span several tokens."""
    tok = RawTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": {"content": "</s>"}, "bos_token": "<s>", "chat_template": "{{x}}"})
    )
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 7]}))
    return HFTokenizer.from_dir(tmp_path, eos_token_ids=[1])


@cache
def _metaspace_bpe() -> HFTokenizer:
    """A SentencePiece-style tokenizer: spaces become '▁' and a leading one is dropped."""
    tok = RawTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["</s>"], show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    return HFTokenizer(tok, eos_token_ids=[0])


@cache
def _bpe() -> HFTokenizer:
    # Module-wide rather than a fixture: hypothesis tests cannot take function fixtures.
    with tempfile.TemporaryDirectory() as d:
        return _byte_level_bpe(Path(d))


@pytest.fixture
def bpe() -> HFTokenizer:
    return _bpe()


def _stream(tok: Tokenizer, ids: list[int]) -> list[str]:
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.feed(i) for i in ids]
    deltas.append(detok.flush())
    assert detok.token_ids == ids
    return deltas


# ---- plain tokenizers -------------------------------------------------------------------


def test_byte_tokenizer_round_trip() -> None:
    tok = ByteTokenizer(512)
    ids = tok.encode("héllo 🚀")
    assert ids[0] == ByteTokenizer.BOS and len(ids) == 1 + len("héllo 🚀".encode())
    assert tok.decode([*ids, ByteTokenizer.EOS, 400]) == "héllo 🚀"  # specials, padding dropped
    assert tok.encode("a", add_special_tokens=False) == [97]
    assert tok.vocab_size == 512 and tok.eos_token_ids == (ByteTokenizer.EOS,)
    assert isinstance(tok, Tokenizer)
    with pytest.raises(ValueError):
        ByteTokenizer(100)


def test_hf_tokenizer_reads_specials_and_template(bpe: HFTokenizer) -> None:
    assert isinstance(bpe, Tokenizer)
    eos = bpe._tok.token_to_id("</s>")
    assert set(bpe.eos_token_ids) == {1, 7, eos}
    assert len(bpe.eos_token_ids) == len(set(bpe.eos_token_ids))
    assert bpe.bos_token_id == bpe._tok.token_to_id("<s>")
    assert bpe.chat_template == "{{x}}"
    text = "你好 fleet 🚀"
    assert bpe.decode(bpe.encode(text)) == text


def test_hf_tokenizer_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"no tokenizer\.json"):
        HFTokenizer.from_dir(tmp_path)


# ---- incremental detokenizer ----------------------------------------------------------


def test_emoji_split_across_byte_tokens_is_held_back() -> None:
    tok = ByteTokenizer()
    ids = tok.encode("a🚀b", add_special_tokens=False)  # 'a', 4 bytes of 🚀, 'b'
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.feed(i) for i in ids]
    assert deltas == ["a", "", "", "", "🚀", "b"]
    assert detok.flush() == ""


def test_cjk_through_byte_level_bpe(bpe: HFTokenizer) -> None:
    text = "多字节字符🇫🇷 done"
    ids = bpe.encode(text)
    deltas = _stream(bpe, ids)
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)


def test_incomplete_tail_comes_out_on_flush() -> None:
    tok = ByteTokenizer()
    ids = list("ok🚀".encode())[:-1]  # the emoji's last byte never arrives
    detok = IncrementalDetokenizer(tok)
    assert "".join(detok.feed(i) for i in ids) == "ok"
    assert detok.flush() == "\ufffd"


def test_context_ids_shape_but_are_not_emitted() -> None:
    tok = _metaspace_bpe()
    prompt, reply = tok.encode("Hello world"), tok.encode(" the fleet")
    detok = IncrementalDetokenizer(tok, context_ids=prompt)
    text = "".join(detok.feed(i) for i in reply) + detok.flush()
    assert text == tok.decode(prompt + reply)[len(tok.decode(prompt)) :]
    assert detok.token_ids == reply


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=60))
def test_byte_stream_of_valid_text(text: str) -> None:
    tok = ByteTokenizer()
    deltas = _stream(tok, tok.encode(text, add_special_tokens=False))
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas) or "\ufffd" in text


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=40), st.lists(st.sampled_from([256, 257, 258]), max_size=3))
def test_byte_stream_of_arbitrary_bytes(data: bytes, specials: list[int]) -> None:
    tok = ByteTokenizer()
    ids = list(data) + specials
    deltas = _stream(tok, ids)
    assert "".join(deltas) == tok.decode(ids)
    assert all(not d.endswith("\ufffd") for d in deltas[:-1]) or data.count(b"\xef\xbf\xbd")


@settings(max_examples=100, deadline=None)
@given(st.text(alphabet=st.sampled_from("ab 你好字🚀🔥éü\n"), max_size=40))
def test_bpe_stream_matches_decode(text: str) -> None:
    for tok in (_bpe(), _metaspace_bpe()):
        ids = tok.encode(text)
        deltas = _stream(tok, ids)
        assert "".join(deltas) == tok.decode(ids)
        assert all("\ufffd" not in d for d in deltas)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 399), max_size=30))
def test_bpe_stream_of_arbitrary_ids(ids: list[int]) -> None:
    # Random ids can form invalid UTF-8; concatenation must still equal decode().
    assert "".join(_stream(_bpe(), ids)) == _bpe().decode(ids)


CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_chat_template_saved_by_transformers_today_is_found(tmp_path: Path) -> None:
    """transformers >= 4.43 writes the template to chat_template.jinja, not into
    tokenizer_config.json: a folder saved that way must still serve chat jobs."""
    from transformers import PreTrainedTokenizerFast

    from tokenfleet.model.chat import render_chat

    _byte_level_bpe(tmp_path)
    fast = PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"))
    fast.chat_template = CHATML
    saved = tmp_path / "saved"
    fast.save_pretrained(saved)
    config = json.loads((saved / "tokenizer_config.json").read_text())
    assert (saved / "chat_template.jinja").is_file() and "chat_template" not in config
    tok = HFTokenizer.from_dir(saved)
    assert tok.chat_template == CHATML
    turns = [{"role": "user", "content": "hi"}]
    want = fast.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
    assert render_chat(tok, turns) == want


def test_chat_template_json_and_precedence(tmp_path: Path) -> None:
    _byte_level_bpe(tmp_path)  # tokenizer_config.json holds "{{x}}"
    (tmp_path / "chat_template.json").write_text(json.dumps({"chat_template": "{{json}}"}))
    assert HFTokenizer.from_dir(tmp_path).chat_template == "{{json}}"
    (tmp_path / "chat_template.jinja").write_text("{{jinja}}")
    assert HFTokenizer.from_dir(tmp_path).chat_template == "{{jinja}}"
    (tmp_path / "chat_template.jinja").write_bytes(b"\xff\xfe{{")
    with pytest.raises(ModelLoadError, match=r"chat_template\.jinja"):
        HFTokenizer.from_dir(tmp_path)
