"""The runner's logprobs (token ids and floats) as the wire's `TokenLogprob` (with texts).

A client (the gateway has no tokenizer) is told each token's own text:
`tokenizer.decode([id])` with special tokens kept. A token that is part of a UTF-8
sequence decodes to U+FFFD, as the tokenizer writes it. Texts are cached per engine:
top-logprob lists name the same few thousand tokens over and over.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tokenfleet.protocol import TokenLogprob
from tokenfleet.seam import TokenLogprobs

if TYPE_CHECKING:
    from tokenfleet.model.tokenizer import Tokenizer


class TokenTexts:
    """Token id -> its own text (empty for a model without a tokenizer), memoised."""

    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self.tokenizer = tokenizer
        self._texts: dict[int, str] = {}

    def text(self, token_id: int) -> str:
        found = self._texts.get(token_id)
        if found is None:
            found = ""
            if self.tokenizer is not None:
                found = self.tokenizer.decode([token_id], skip_special_tokens=False)
            self._texts[token_id] = found
        return found

    def logprob(self, token_id: int, sampled: TokenLogprobs) -> TokenLogprob:
        """The wire form of `sampled`, the logprobs of `token_id`'s position."""
        texts, text = self._texts, self.text
        top = [(t, lp, texts.get(t) or text(t)) for t, lp in sampled.top]
        return TokenLogprob(
            logprob=sampled.logprob, token=texts.get(token_id) or text(token_id), top=top
        )
