"""Feeding helpers shared by the output-splitter and tool-parser tests."""

from __future__ import annotations

import random
import re
from typing import Callable, Iterable

from ninfer.frontend.output_split import (
    Delta,
    ReasoningDelta,
    TextDelta,
    ToolCallArgs,
    ToolCallEnd,
    ToolCallStart,
)

CALL_ID = re.compile(r"call_[0-9a-f]{16,}")


def timeline(deltas: Iterable[Delta]) -> list[tuple]:
    """Deltas as ("reasoning", s) / ("text", s) / ("call", name, args) with neighbours merged.

    Also checks the call invariants: indices count up from 0, ids are unique and
    well-formed, and a call's fragments concatenate to its final arguments.
    """
    out: list[tuple] = []
    calls: dict[int, list] = {}
    ids: set[str] = set()
    for d in deltas:
        if isinstance(d, (TextDelta, ReasoningDelta)):
            kind = "text" if isinstance(d, TextDelta) else "reasoning"
            if out and out[-1][0] == kind:
                out[-1] = (kind, out[-1][1] + d.text)
            elif d.text:
                out.append((kind, d.text))
        elif isinstance(d, ToolCallStart):
            assert d.index == len(calls) and CALL_ID.fullmatch(d.id) and d.id not in ids
            ids.add(d.id)
            calls[d.index] = [d.name, ""]
        elif isinstance(d, ToolCallArgs):
            calls[d.index][1] += d.fragment
        else:
            assert isinstance(d, ToolCallEnd) and calls[d.index][1] == d.arguments
            out.append(("call", calls[d.index][0], d.arguments))
    return out


def run_chunks(make: Callable, chunks: Iterable[str]) -> list[Delta]:
    """Feed ``chunks`` to a fresh parser/splitter from ``make()`` and finish it."""
    target = make()
    deltas: list[Delta] = []
    for chunk in chunks:
        deltas += target.feed(chunk)
    return deltas + target.finish()


def chunkings(text: str, seed: int = 0, random_runs: int = 20) -> Iterable[list[str]]:
    """Every two-way split, character by character, and seeded random chunkings."""
    for k in range(len(text) + 1):
        yield [text[:k], text[k:]]
    yield list(text)
    rng = random.Random(seed)
    for _ in range(random_runs):
        cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(1, 12))))
        yield [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


def assert_stream_equals_oneshot(make: Callable, text: str) -> list[tuple]:
    """Every chunking of ``text`` yields the one-shot timeline; returns it."""
    expected = timeline(run_chunks(make, [text]))
    for chunks in chunkings(text):
        assert timeline(run_chunks(make, chunks)) == expected, chunks
    return expected
