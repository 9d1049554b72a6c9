"""Incremental detokenization: token ids in, text deltas out, never a broken character.

Byte-level BPE tokens can end in the middle of a UTF-8 character, and SentencePiece-style
tokenizers drop or add leading spaces depending on context. Decoding each token alone is
therefore wrong. As in vLLM, we decode a short window of recent tokens twice (without and
with the new ones) and emit the difference; a window whose text ends in U+FFFD (an
incomplete character) is held back until a later token completes it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

# Tokens of context decoded before the new ones, so leading-space rules see a real prefix.
_PREFIX_WINDOW = 6
_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Turns one request's output tokens into text, one delta per appended token."""

    def __init__(
        self, tokenizer: Any, prompt_token_ids: Sequence[int], skip_special_tokens: bool = True
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        # The window starts inside the prompt so the first output token has context.
        self._ids: list[int] = list(prompt_token_ids[-_PREFIX_WINDOW:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._text = ""

    @property
    def text(self) -> str:
        """All output text emitted so far (complete characters only)."""
        return self._text

    @property
    def pending(self) -> bool:
        """True while some appended bytes are held back (an incomplete character)."""
        return self._read_offset < len(self._ids)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(
            ids,
            skip_special_tokens=self.skip_special_tokens,
            clean_up_tokenization_spaces=False,
        )

    def append(self, token_id: int) -> str:
        """Add one output token; returns the newly completed text (may be empty).

        Special tokens add no text when ``skip_special_tokens`` (the tokenizer decides which
        tokens are special, exactly as ``tokenizer.decode`` does)."""
        self._ids.append(token_id)
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._decode(self._ids[self._prefix_offset :])
        if len(full) <= len(prefix) or full.endswith(_REPLACEMENT):
            return ""  # nothing new, or the last character is still incomplete
        delta = full[len(prefix) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self._text += delta
        return delta

    def flush(self) -> str:
        """At the end of a request: emit held-back bytes (as U+FFFD if still incomplete)."""
        if not self.pending:
            return ""
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._decode(self._ids[self._prefix_offset :])
        delta = full[len(prefix) :]
        self._prefix_offset = self._read_offset = len(self._ids)
        self._text += delta
        return delta
