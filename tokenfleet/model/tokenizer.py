"""Tokenizers: a wrapper over a Hugging Face `tokenizer.json`, and a byte-level one for presets."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from tokenizers import Tokenizer as _HFTokenizer

from tokenfleet.errors import ModelLoadError


@runtime_checkable
class Tokenizer(Protocol):
    """What the engine needs from a tokenizer. Ids are plain ints."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def bos_token_id(self) -> int | None: ...

    @property
    def eos_token_ids(self) -> tuple[int, ...]: ...

    @property
    def chat_template(self) -> str | None: ...

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str: ...


class HFTokenizer:
    """A `tokenizers.Tokenizer` loaded from a checkpoint folder's `tokenizer.json`.

    `tokenizer_config.json` and `generation_config.json`, when present, supply the
    eos/bos tokens; `chat_template.jinja`, `chat_template.json` or
    `tokenizer_config.json` (the first that has one) the chat template, kept as the
    raw Jinja string (rendering it is the caller's business).
    """

    def __init__(
        self,
        tokenizer: _HFTokenizer,
        *,
        bos_token_id: int | None = None,
        eos_token_ids: Iterable[int] = (),
        chat_template: str | None = None,
    ) -> None:
        self._tok = tokenizer
        self._bos = bos_token_id
        self._eos = tuple(dict.fromkeys(eos_token_ids))  # de-duplicated, order kept
        self._chat_template = chat_template

    @classmethod
    def from_dir(cls, path: str | Path, *, eos_token_ids: Iterable[int] = ()) -> HFTokenizer:
        """Load `path/tokenizer.json`; `eos_token_ids` (e.g. from config.json) are added
        to the ones the tokenizer files name."""
        folder = Path(path)
        tok_file = folder / "tokenizer.json"
        if not tok_file.is_file():
            raise ModelLoadError(f"no tokenizer.json in {folder}")
        try:
            tok = _HFTokenizer.from_file(str(tok_file))
        except Exception as e:  # the Rust side raises a bare Exception
            raise ModelLoadError(f"cannot read {tok_file}: {e}") from e
        cfg = _read_json(folder / "tokenizer_config.json")
        gen = _read_json(folder / "generation_config.json")
        eos = list(eos_token_ids)
        eos += _ids_of(gen.get("eos_token_id"))
        eos_tok = _token_id(tok, cfg.get("eos_token"))
        if eos_tok is not None:
            eos.append(eos_tok)
        bos = _token_id(tok, cfg.get("bos_token"))
        if bos is None and isinstance(gen.get("bos_token_id"), int):
            bos = gen["bos_token_id"]
        template = _template(folder, cfg)
        return cls(tok, bos_token_id=bos, eos_token_ids=eos, chat_template=template)

    @property
    def vocab_size(self) -> int:
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    @property
    def bos_token_id(self) -> int | None:
        return self._bos

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self._eos

    @property
    def chat_template(self) -> str | None:
        return self._chat_template

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return str(self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def to_json(self) -> str:
        """The tokenizer as `tokenizer.json` text (what grammar libraries load)."""
        return str(self._tok.to_str())


class ByteTokenizer:
    """One token per UTF-8 byte, for presets that must run with no files.

    Ids 0..255 are the bytes, then BOS, EOS and PAD; the vocab is padded to the
    model's `vocab_size` and ids past the specials decode to nothing.
    """

    NUM_BYTES = 256
    BOS = 256
    EOS = 257
    PAD = 258

    def __init__(self, vocab_size: int = PAD + 1, chat_template: str | None = None) -> None:
        if vocab_size < self.PAD + 1:
            raise ValueError(f"a byte tokenizer needs vocab_size >= {self.PAD + 1}")
        self._vocab_size = vocab_size
        self._chat_template = chat_template

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def bos_token_id(self) -> int | None:
        return self.BOS

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return (self.EOS,)

    @property
    def chat_template(self) -> str | None:
        return self._chat_template

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [self.BOS, *ids] if add_special_tokens else ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        # Specials have no byte form, so they are dropped either way.
        data = bytes(i for i in ids if 0 <= i < self.NUM_BYTES)
        return data.decode("utf-8", errors="replace")


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        d = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{path} is not valid JSON: {e}") from e
    return d if isinstance(d, dict) else {}


def _ids_of(value: Any) -> list[int]:
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int)]
    return []


def _token_id(tok: _HFTokenizer, token: Any) -> int | None:
    # tokenizer_config.json spells special tokens as a string or {"content": ...}.
    content = token.get("content") if isinstance(token, dict) else token
    if not isinstance(content, str):
        return None
    tid = tok.token_to_id(content)
    return int(tid) if tid is not None else None


def _template(folder: Path, cfg: dict[str, Any]) -> str | None:
    """The chat template, where transformers looks for it: `chat_template.jinja` (what
    transformers >= 4.43 saves), `chat_template.json`, then `tokenizer_config.json`."""
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        try:
            return jinja.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ModelLoadError(f"cannot read {jinja}: {e}") from e
    for source in (_read_json(folder / "chat_template.json"), cfg):
        found = _named_template(source.get("chat_template"))
        if found is not None:
            return found
    return None


def _named_template(tpl: Any) -> str | None:
    if isinstance(tpl, str):
        return tpl
    if isinstance(tpl, list):  # named templates: prefer "default"
        named = {t.get("name"): t.get("template") for t in tpl if isinstance(t, dict)}
        chosen = named.get("default") or next(iter(named.values()), None)
        return chosen if isinstance(chosen, str) else None
    return None
