"""Incremental detokenization: token ids in, text deltas out, never a broken character.

Byte-level BPE tokens can end in the middle of a UTF-8 character, and SentencePiece-style
tokenizers drop or add leading spaces depending on context. Decoding each token alone is
therefore wrong. As in vLLM, we decode a short window of recent tokens twice (without and
with the new ones) and emit the difference; a window whose text ends in U+FFFD (an
incomplete character) is held back until a later token completes it.

A migrated request arrives with the tokens streamed before the migration at the end of its
prompt. Its detokenizer replays them first, so that it holds the same window, the same
held-back bytes and the same text as the uninterrupted run at that point: a character whose
bytes straddle the migration point then comes out whole, once.
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
        self,
        tokenizer: Any,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
        num_prior_output_tokens: int = 0,
    ) -> None:
        """``num_prior_output_tokens``: how many of the prompt's last tokens are outputs
        produced before a migration; they are replayed, and their text is part of ``text``."""
        if not 0 <= num_prior_output_tokens <= len(prompt_token_ids):
            raise ValueError(
                f"num_prior_output_tokens must be in [0, {len(prompt_token_ids)}] (the prompt's "
                f"length), got {num_prior_output_tokens}"
            )
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        split = len(prompt_token_ids) - num_prior_output_tokens
        # The window starts inside the prompt so the first output token has context.
        self._ids: list[int] = list(prompt_token_ids[max(0, split - _PREFIX_WINDOW) : split])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._text = ""
        for token_id in prompt_token_ids[split:]:
            self.append(token_id)

    @property
    def text(self) -> str:
        """All output text so far, prior outputs' included (complete characters only)."""
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
