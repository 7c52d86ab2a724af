"""Each reuse path and each checkpoint limit through the whole engine, on a dense and a
hybrid tiny model: the path a request reports, and outputs equal to a run without reuse."""

from __future__ import annotations

import pytest

from ninfer import LLM
from ninfer.engine.context_cache import CacheHints
from ninfer.engine.request import EngineRequest
from ninfer.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=6, temperature=0, presence_penalty=0.0, ignore_eos=True)
PROLOGUE = [7, 8, 9]  # stands in for the generation prologue a chat prompt ends with

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module", params=["qwen3", "qwen3_5"])
def tiny(request, tmp_path_factory):
    if request.param == "qwen3":
        return request.getfixturevalue("tiny_qwen3")
    from ninfer.tiny.make import make_tiny

    return make_tiny(tmp_path_factory.mktemp("tiny-qwen3_5"), "qwen3_5", seed=0)


def _llm(path, **overrides) -> LLM:
    settings = dict(dtype="fp32", device="cpu", max_concurrency=1, prefill_chunk=32, block_size=4, max_context=256)
    return LLM(str(path), **{**settings, **overrides})


class Driver:
    """Runs one request at a time; remembers each one's output, cached tokens and path."""

    def __init__(self, llm: LLM):
        self.llm, self.n = llm, 0

    def run(self, history: list[int], new: list[int], shared: tuple[int, ...] = (), replay: bool = False):
        prompt = history + new + PROLOGUE
        hints = CacheHints(turn_closure=len(prompt) - len(PROLOGUE), shared=shared, replay=replay)
        self.n += 1
        engine = self.llm.engine
        engine.add_request(EngineRequest(f"q{self.n}", prompt, GREEDY, cache_hints=hints))
        out: list[int] = []
        while engine.has_unfinished():
            for event in engine.step():
                out += event.token_ids
                if event.finished:
                    final = event
        return prompt, out, final.num_cached_tokens, final.timings.reuse_path


def _tokens(seed: int, n: int) -> list[int]:
    return [(seed * 37 + i * 11) % 200 + 20 for i in range(n)]


SYSTEM = _tokens(1, 24)


def _script(d: Driver) -> list[tuple[list[int], str, int]]:
    """A conversation over three turns, a second conversation sharing the marked system
    prompt, an edit deep in the first one's history, and a replayed turn."""
    results = []

    def note(run, history_len=None):
        prompt, out, cached, path = run
        results.append((out, path, cached))
        return prompt, out

    p1, o1 = note(d.run(SYSTEM, _tokens(2, 20), shared=(24,)))
    p2, o2 = note(d.run(p1[:-3], _tokens(3, 20)))  # the next turn: closure reused
    p3, o3 = note(d.run(p2 + o2, _tokens(4, 20)))  # the reply sent back verbatim: endpoint reused
    note(d.run(SYSTEM, _tokens(5, 20), shared=(24,)))  # another conversation, same marked system prompt
    note(d.run(p1[:-3], _tokens(6, 20)))  # an edit after turn 1: the anchor at its closure
    note(d.run(p3[:-3], _tokens(7, 8), replay=True))  # a stored response replayed
    return results


@pytest.fixture(scope="module")
def reference(tiny):
    return [out for out, _, _ in _script(Driver(_llm(tiny, no_prefix_reuse=True)))]


def _anchored(llm: LLM) -> LLM:
    llm.engine.block_manager.context.anchor_spacing = 16  # tokens, for prompts this short
    return llm


def test_every_path_is_named_and_changes_no_output(tiny, reference):
    results = _script(Driver(_anchored(_llm(tiny))))
    assert [out for out, _, _ in results] == reference
    assert [path for _, path, _ in results] == [
        "root", "private_turn_closure", "private_endpoint", "shared_stable_prefix", "private_long_anchor",
        "private_response_replay"]
    assert results[3][2] == 24  # the marked system prompt, exactly


def test_limits_of_zero_keep_no_checkpoints_of_that_kind(tiny, reference):
    llm = _anchored(_llm(tiny, max_private_continuations=0, max_shared_prefixes=0))
    results = _script(Driver(llm))
    assert [out for out, _, _ in results] == reference
    paths = [path for _, path, _ in results]
    assert not any(p.startswith(("private", "shared")) for p in paths), paths
    ctx = llm.engine.block_manager.context
    assert ctx.num_continuations == 0 and ctx.num_shared == 0


def test_anchor_limit(tiny, reference):
    llm = _anchored(_llm(tiny, max_long_anchors_per_continuation=0))
    results = _script(Driver(llm))
    assert [out for out, _, _ in results] == reference
    assert results[4][1] != "private_long_anchor" and llm.engine.block_manager.context.num_anchors == 0


def test_private_limit_keeps_the_most_recent_conversations(tiny):
    llm = _llm(tiny, max_private_continuations=1)
    d = Driver(llm)
    first, _, _, _ = d.run(_tokens(8, 30), [])
    d.run(_tokens(9, 30), [])  # a second conversation takes the only private slot
    *_, path = d.run(first[:-3], _tokens(10, 5))
    assert path != "private_turn_closure"
    assert llm.engine.block_manager.context.stats.continuations_evicted >= 1


def test_no_prefix_reuse_reports_root(tiny):
    d = Driver(_llm(tiny, no_prefix_reuse=True))
    p, *_ = d.run(_tokens(11, 30), [])
    assert d.run(p[:-3], [5])[3] == "root"
