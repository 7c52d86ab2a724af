"""Keep the exact tokens of a stored turn when its continuation re-renders it unchanged.

A model's own output is not always the tokenizer's canonical encoding of its text, so
re-tokenizing a replayed history can change tokens the engine already holds KV for,
and prefix reuse then stops short. When a child Response's rendered prompt begins
with its parent's prompt text followed by the parent's output text, that prefix is
taken as the parent's prompt tokens plus the tokens it generated, and only the rest
is tokenized. The split must fall on an added (control) token, where a tokenizer
splits text anyway, so the result is a faithful encoding of the same text.

Whether the template re-renders the parent turn unchanged is the template's business:
Qwen templates drop the reasoning of closed turns unless ``preserve_thinking`` is on,
and the empty reasoning block of a non-thinking turn, in which case the whole prompt
is tokenized afresh and reuse covers the common prefix only.
"""

from __future__ import annotations

import hashlib
from array import array
from typing import Any, Optional, Sequence

import attrs


def _digest(text: str) -> bytes:
    return hashlib.blake2b(text.encode("utf-8"), digest_size=16).digest()


@attrs.frozen
class Transcript:
    """One generation: the prompt it saw (ids, plus the text's length and digest) and its output."""

    prompt_ids: array
    output_ids: array
    prompt_chars: int
    prompt_digest: bytes
    output_text: str

    @classmethod
    def of(cls, prompt: str, prompt_ids: Sequence[int], output_ids: Sequence[int], tokenizer: Any) -> "Transcript":
        return cls(array("i", prompt_ids), array("i", output_ids), len(prompt), _digest(prompt),
                   tokenizer.decode(list(output_ids), skip_special_tokens=False))

    @property
    def nbytes(self) -> int:
        return (len(self.prompt_ids) + len(self.output_ids)) * self.prompt_ids.itemsize + len(self.output_text)

    def splice(self, prompt: str, tokenizer: Any, markers: Sequence[str]) -> Optional[list[int]]:
        """Token ids of ``prompt`` reusing this transcript's, or None when it does not continue it."""
        end = self.prompt_chars + len(self.output_text)
        if len(prompt) < end or prompt[self.prompt_chars:end] != self.output_text:
            return None
        if _digest(prompt[: self.prompt_chars]) != self.prompt_digest:
            return None
        rest = prompt[end:]
        spoken = prompt[:end]
        if rest and not any(rest.startswith(m) or spoken.endswith(m) for m in markers):
            return None  # the tokenizer might merge across this point
        return [*self.prompt_ids, *self.output_ids, *tokenizer.encode(rest)]


def added_markers(tokenizer: Any) -> tuple[str, ...]:
    """Texts of the tokenizer's added tokens, which it always splits text around."""
    backend = getattr(tokenizer, "backend", None)
    if backend is None:
        return ()
    return tuple(t.content for t in backend.get_added_tokens_decoder().values() if t.content)


def encode_prompt(prompt: str, tokenizer: Any, markers: Sequence[str], parent: Optional[Transcript]) -> list[int]:
    spliced = parent.splice(prompt, tokenizer, markers) if parent is not None else None
    return spliced if spliced is not None else tokenizer.encode(prompt)
