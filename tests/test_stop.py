"""Stop-string matching with holdback over streamed chunks."""

from __future__ import annotations

import random

import pytest

from ninfer.engine.stop import StopMatcher


def run(matcher: StopMatcher, chunks: list[str]) -> tuple[list[str], str | None]:
    """Feed chunks until a match; return every emitted piece (flush included) and the match."""
    out = []
    for chunk in chunks:
        emit, matched = matcher.feed(chunk)
        out.append(emit)
        if matched is not None:
            return out, matched
    out.append(matcher.flush())
    return out, None


def test_no_stops_passes_text_through() -> None:
    m = StopMatcher([])
    assert m.feed("abc#") == ("abc#", None)
    assert m.flush() == ""


def test_partial_stop_is_held_back_then_released() -> None:
    m = StopMatcher(["###"])
    assert m.feed("abc#") == ("abc", None)
    assert m.feed("#") == ("", None)
    assert m.feed("x#") == ("##x", None)
    assert m.flush() == "#"
    assert m.flush() == ""


def test_match_spanning_many_feeds() -> None:
    m = StopMatcher(["<|stop|>"])
    pieces, matched = run(m, list("hello <|stop|> ignored"))
    assert "".join(pieces) == "hello "
    assert matched == "<|stop|>" and m.matched == "<|stop|>"


def test_include_stop_str() -> None:
    pieces, matched = run(StopMatcher(["END"], include_stop_str=True), ["abc E", "N", "D tail"])
    assert "".join(pieces) == "abc END" and matched == "END"


def test_earliest_start_wins_then_longest() -> None:
    assert StopMatcher(["world", "lo w"]).feed("hello world") == ("hel", "lo w")
    assert StopMatcher(["ab", "abc"]).feed("xabcd") == ("x", "abc")
    assert StopMatcher(["abc", "ab"]).feed("xabcd") == ("x", "abc")
    # a later chunk can't reorder a match already complete earlier
    m = StopMatcher(["ab", "xabc"])
    assert m.feed("xa") == ("", None)
    assert m.feed("bc") == ("", "xabc")


def test_held_text_that_stops_being_a_prefix_is_emitted_in_order() -> None:
    m = StopMatcher(["abcd", "bce"])
    assert m.feed("xabc") == ("x", None)
    assert m.feed("e") == ("a", "bce")


def test_after_match_stream_is_closed() -> None:
    m = StopMatcher(["!"])
    assert m.feed("hi!") == ("hi", "!")
    assert m.flush() == ""
    with pytest.raises(RuntimeError):
        m.feed("more")


def test_empty_stop_rejected() -> None:
    with pytest.raises(ValueError):
        StopMatcher(["ok", ""])


def reference(text: str, cuts: list[int], stops: list[str], include: bool) -> tuple[str, str | None]:
    """What a matcher must produce: at the first chunk end by which a stop has fully appeared,
    the earliest-starting (then longest) occurrence wins."""
    for end in cuts:
        found = [(text.find(s), -len(s), s) for s in stops if 0 <= text.find(s) <= end - len(s)]
        if found:
            start, _, stop = min(found)
            return text[: start + (len(stop) if include else 0)], stop
    return text, None


@pytest.mark.parametrize("seed", range(300))
def test_random_streams_match_reference(seed: int) -> None:
    rng = random.Random(seed)
    alphabet = "ab#\n "
    stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))]
    text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40)))
    cuts = sorted({0, len(text), *(rng.randint(0, len(text)) for _ in range(rng.randint(0, 10)))})
    chunks = [text[a:b] for a, b in zip(cuts, cuts[1:])]
    include = rng.random() < 0.5
    m = StopMatcher(stops, include_stop_str=include)
    expected_text, expected_stop = reference(text, cuts[1:], stops, include)
    emitted = ""
    for chunk in chunks:
        emit, matched = m.feed(chunk)
        emitted += emit
        # nothing emitted may belong to a stop string
        assert expected_text.startswith(emitted)
        if matched is not None:
            break
    else:
        matched = None
        emitted += m.flush()
    assert (emitted, matched) == (expected_text, expected_stop)
