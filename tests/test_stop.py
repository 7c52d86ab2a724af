"""Stop-string matching with holdback over streamed chunks; stop tokens and min_tokens."""

from __future__ import annotations

import random

import pytest

from ninfer import LLM, SamplingParams
from ninfer.engine.defaults import stop_token_ids
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


# -- stop tokens and min_tokens --------------------------------------------------------------
@pytest.fixture(scope="module")
def llm():
    return LLM("tiny:qwen3", device="cpu", dtype="fp32", max_context=128, max_concurrency=4)


@pytest.fixture(scope="module")
def llm_ahead():
    """The CUDA path's decode steps launched ahead, run synchronously here."""
    return LLM("tiny:qwen3", device="cpu", dtype="fp32", max_context=128, max_concurrency=4,
               decode_ahead_on_cpu=True)


def test_stop_token_ids_add_end_of_sequence_unless_ignored() -> None:
    assert stop_token_ids(SamplingParams(stop_token_ids=[5, 7]), [7, 9]) == (5, 7, 9)
    assert stop_token_ids(SamplingParams(stop_token_ids=[5], ignore_eos=True), [7, 9]) == (5,)


@pytest.mark.parametrize("which", ["llm", "llm_ahead"])
def test_min_tokens_masks_stop_tokens_instead_of_ignoring_them(request, which):
    """A stop token the model wants at once is never sampled before min_tokens outputs."""
    llm = request.getfixturevalue(which)
    eos = llm.get_tokenizer().eos_token_ids
    params = [SamplingParams(temperature=t, seed=3, max_tokens=20, min_tokens=5,
                             logit_bias={e: 100.0 for e in eos}) for t in (0.0, 1.0)]
    outs = llm.generate(["hi", "hello"], params)
    for o in outs:
        c = o.outputs[0]
        assert c.finish_reason == "stop" and len(c.token_ids) == 6, c
        assert not set(c.token_ids[:5]) & set(eos) and c.token_ids[5] in eos and c.stop_reason == c.token_ids[5]


def test_min_tokens_masks_a_request_s_own_stop_token_ids(llm):
    tok = llm.get_tokenizer()
    stop = tok.encode("a")[0]
    params = SamplingParams(temperature=0, max_tokens=20, min_tokens=3, stop_token_ids=[stop],
                            logit_bias={stop: 100.0}, ignore_eos=True)
    c = llm.generate("x", params)[0].outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == stop and len(c.token_ids) == 4
    assert stop not in c.token_ids[:3]


def test_with_ignore_eos_min_tokens_leaves_end_of_sequence_alone(llm):
    eos = llm.get_tokenizer().eos_token_ids
    params = SamplingParams(temperature=0, max_tokens=6, min_tokens=4, ignore_eos=True, logit_bias={eos[0]: 100.0})
    c = llm.generate("x", params)[0].outputs[0]
    assert c.finish_reason == "length" and c.token_ids == [eos[0]] * 6  # not a stop token here


def test_an_unarmed_matcher_never_matches_but_still_holds_a_stop_s_start() -> None:
    m = StopMatcher(["END"])
    assert m.feed("xEND E", armed=False) == ("xEND ", None)  # before min_tokens: ordinary text
    assert m.feed("ND tail") == ("", "END")  # completed by the first armed chunk: never leaked


def test_min_tokens_also_holds_off_stop_strings(llm):
    """As in vLLM, a stop string ends the output only once it holds more than min_tokens tokens."""
    tok = llm.get_tokenizer()
    a = tok.encode("a")[0]
    bias = {a: 100.0}  # greedy writes "a" at every position, so "a" matches at once without min_tokens
    early = llm.generate("x", SamplingParams(temperature=0, max_tokens=20, stop=["a"], logit_bias=bias,
                                             ignore_eos=True))[0].outputs[0]
    assert early.finish_reason == "stop" and len(early.token_ids) == 1 and early.text == ""
    c = llm.generate("x", SamplingParams(temperature=0, max_tokens=20, min_tokens=5, stop=["a"], logit_bias=bias,
                                         ignore_eos=True))[0].outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == "a" and len(c.token_ids) == 6
    assert c.text == "a" * 5  # the five before min_tokens was reached are ordinary output
