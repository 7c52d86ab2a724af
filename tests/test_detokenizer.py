"""Incremental detokenization: equals a full decode, never splits a character, bounded cost."""

from __future__ import annotations

import random
from typing import Sequence

import pytest

from ninfer.engine.detokenizer import MAX_HELD_TOKENS, IncrementalDetokenizer
from ninfer.tokenizer import Tokenizer

VALID_TEXTS = [
    "plain ascii text with some words",
    "emoji 🙂👍🏽🚀 family 👨‍👩‍👧 and ❤️ end",
    "中文测试：你好，世界！日本語のテキスト。한국어 문장",
    "Café über straße — naïve…",
    '{"city": "Zürich", "emoji": "🎉"}\n<think>\nplan\n</think>\n\nanswer<|im_end|>',
    "a legitimate replacement char \ufffd stays",
]


class CountingDecoder:
    """Wraps a tokenizer and records how many tokens each decode call was given."""

    def __init__(self, tok: Tokenizer):
        self.tok = tok
        self.sizes: list[int] = []

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        self.sizes.append(len(ids))
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)


def stream(detok: IncrementalDetokenizer, ids: list[int], rng: random.Random | None = None) -> list[str]:
    pieces, i = [], 0
    while i < len(ids):
        step = rng.randint(1, 4) if rng else 1
        pieces.append(detok.push(ids[i : i + step]))
        i += step
    pieces.append(detok.flush())
    return pieces


@pytest.mark.parametrize("seed", range(150))
def test_random_ids_concatenate_to_full_decode(tok: Tokenizer, seed: int) -> None:
    rng = random.Random(seed)
    ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(0, 80))]
    skip = seed % 2 == 0
    pieces = stream(IncrementalDetokenizer(tok, skip_special_tokens=skip), ids, rng)
    assert "".join(pieces) == tok.decode(ids, skip_special_tokens=skip)


@pytest.mark.parametrize("text", VALID_TEXTS)
def test_valid_text_never_yields_replacement_mid_stream(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text)
    pieces = stream(IncrementalDetokenizer(tok, skip_special_tokens=False), ids)
    assert "".join(pieces) == text
    if "\ufffd" not in text:
        assert not any("\ufffd" in p for p in pieces)


def test_split_characters_are_held_back(tok: Tokenizer) -> None:
    ids = tok.encode("🙂")
    assert len(ids) > 1, "the tiny vocabulary must split this emoji for the test to mean anything"
    detok = IncrementalDetokenizer(tok)
    assert [detok.push([i]) for i in ids] == [""] * (len(ids) - 1) + ["🙂"]
    assert detok.flush() == ""


def test_flush_releases_incomplete_tail(tok: Tokenizer) -> None:
    ids = tok.encode("ok 中")[:-1]  # drop the last byte token of the character
    detok = IncrementalDetokenizer(tok)
    text = "".join(detok.push([i]) for i in ids)
    assert text == "ok "
    assert text + detok.flush() == tok.decode(ids)


def test_cost_per_token_stays_bounded(tok: Tokenizer) -> None:
    rng = random.Random(7)
    text = " ".join(rng.choice(VALID_TEXTS) for _ in range(60))
    ids = tok.encode(text)
    counter = CountingDecoder(tok)
    pieces = stream(IncrementalDetokenizer(counter), ids)
    assert len(ids) > 1000
    assert "".join(pieces) == tok.decode(ids)
    assert max(counter.sizes) <= 8


def test_endless_invalid_bytes_do_not_grow_the_window(tok: Tokenizer) -> None:
    lone = next(i for i in range(tok.vocab_size) if tok.token_bytes(i) == b"\x80")
    ids = [lone] * 200 + tok.encode("fine")
    counter = CountingDecoder(tok)
    pieces = stream(IncrementalDetokenizer(counter), ids)
    assert max(counter.sizes) <= MAX_HELD_TOKENS + 1
    assert "".join(pieces) == tok.decode(ids) == "\ufffd" * 200 + "fine"


def test_skipped_special_tokens_emit_nothing(tok: Tokenizer) -> None:
    im_end = tok.token_to_id("<|im_end|>")
    detok = IncrementalDetokenizer(tok)
    assert detok.push(tok.encode("hi")) == "hi"
    assert detok.push([im_end]) == ""
    assert detok.push(tok.encode("!")) == "!"
    assert IncrementalDetokenizer(tok, skip_special_tokens=False).push([im_end]) == "<|im_end|>"
