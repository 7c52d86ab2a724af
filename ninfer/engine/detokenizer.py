"""Streaming token-ids -> text that never splits a UTF-8 character.

Byte-level tokens can end in the middle of a character (an emoji is often several
tokens). Each step decodes only a short window: the tokens from ``prefix_offset`` on,
compared with the already-emitted part ``prefix_offset:read_offset``; the difference is
the new text. While that window still ends in U+FFFD the last character may be
incomplete, so nothing is emitted and the window waits for more tokens. Working on a
window keeps the cost per token constant and lets tokenizers whose decoding depends on
neighbouring tokens (SentencePiece-style leading spaces) come out right.
"""

from __future__ import annotations

from typing import Protocol, Sequence

_REPLACEMENT = "\ufffd"

#: tokens a window may hold back before a trailing U+FFFD is taken as final. One
#: character needs at most 4 byte tokens, so only text that really is invalid (or a
#: long run of skipped special tokens) reaches this; it bounds the decode cost.
MAX_HELD_TOKENS = 16


class Decoder(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Feed generated token ids, get the newly completed text."""

    def __init__(self, tokenizer: Decoder, skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix_offset = 0  # window start: context already turned into text
        self._read_offset = 0  # everything before this has been emitted

    def _decode(self, start: int, stop: int | None = None) -> str:
        return self._tokenizer.decode(self._ids[start:stop], skip_special_tokens=self._skip)

    def _advance(self, new_text: str, prefix_len: int) -> str:
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return new_text[prefix_len:]

    def push(self, token_ids: Sequence[int]) -> str:
        """Add tokens; return the text they complete ("" when it must wait)."""
        if not token_ids:
            return ""
        self._ids.extend(token_ids)
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        new_text = self._decode(self._prefix_offset)
        if len(new_text) > len(prefix_text) and not new_text.endswith(_REPLACEMENT):
            return self._advance(new_text, len(prefix_text))
        if len(self._ids) - self._read_offset > MAX_HELD_TOKENS:
            # give up waiting and restart the window after these tokens
            delta = new_text[len(prefix_text) :]
            self._prefix_offset = self._read_offset = len(self._ids)
            return delta
        return ""

    def flush(self) -> str:
        """Release whatever is held back (end of generation), replacement characters included."""
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        new_text = self._decode(self._prefix_offset)
        if len(new_text) <= len(prefix_text):
            return ""
        return self._advance(new_text, len(prefix_text))
