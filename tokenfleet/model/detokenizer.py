"""Turn generated token ids into text deltas as they arrive, one token at a time."""

from __future__ import annotations

from collections.abc import Sequence

from tokenfleet.model.tokenizer import Tokenizer

_REPLACEMENT = "\ufffd"
_CONTEXT_TAIL = 6


class IncrementalDetokenizer:
    """Feed ids one by one, get the text each adds.

    Rules:
    - A delta never ends inside a character: while the decoded tail ends in U+FFFD
      (an incomplete UTF-8 sequence so far), the new text is held back.
    - `"".join(deltas) + flush() == tokenizer.decode(fed ids)`.

    Only a short window is re-decoded per token: `_prefix` marks where the text
    already emitted starts being re-decoded (for context-sensitive decoders, such
    as SentencePiece dropping a leading space) and `_read` where unemitted ids
    begin. Both move only at clean boundaries (after a delta was emitted).
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        context_ids: Sequence[int] = (),
        *,
        skip_special_tokens: bool = True,
    ) -> None:
        """`context_ids` (e.g. the prompt) shape the first delta but are not emitted;
        only their last few ids are kept, which is all a decoder looks back at."""
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = list(context_ids)[-_CONTEXT_TAIL:] if context_ids else []
        self._num_context = len(self._ids)
        self._prefix = 0
        self._read = len(self._ids)

    @property
    def token_ids(self) -> list[int]:
        """The ids fed so far (without the context)."""
        return self._ids[self._num_context :]

    def feed(self, token_id: int) -> str:
        self._ids.append(token_id)
        prefix_text = self._decode(self._prefix, self._read)
        text = self._decode(self._prefix, len(self._ids))
        if text.endswith(_REPLACEMENT) or len(text) <= len(prefix_text):
            return ""  # incomplete character, or a token that adds no text (yet)
        self._prefix, self._read = self._read, len(self._ids)
        return text[len(prefix_text) :]

    def flush(self) -> str:
        """Whatever is held back, even a trailing incomplete sequence (as U+FFFD)."""
        if self._read == len(self._ids):
            return ""
        prefix_text = self._decode(self._prefix, self._read)
        text = self._decode(self._prefix, len(self._ids))
        self._prefix, self._read = self._read, len(self._ids)
        return text[len(prefix_text) :]

    def _decode(self, start: int, stop: int) -> str:
        return self._tok.decode(self._ids[start:stop], skip_special_tokens=self._skip)
