"""The llguidance backend and the engine's guided-decoding parts, piece by piece."""

from __future__ import annotations

from types import SimpleNamespace

import attrs
import pytest
import torch

from ninfer.batch.guides import guide_spec
from ninfer_plugins.reasoning.qwen3 import QWEN3
from ninfer.cli.serve import build_parser
from ninfer.engine.guided_masks import GuidedMasks
from ninfer.engine.guided_setup import build_guided_decoding
from ninfer.engine.guided_state import GuidedState, GuideRejectedError, Phase, ReasoningMarkers
from ninfer.engine.sampler import apply_token_mask
from ninfer.engine.sampling_metadata import TokenMask
from ninfer.guided.spec import GuideSpec
from ninfer.plugins import PluginRegistry, load_registry
from ninfer.profile import check_selections, load_profile
from ninfer.profile.flags import overrides_from_args
from ninfer_plugins.guided import llguidance_backend
from ninfer_plugins.guided.llguidance_grammar import SpecialTokens

VOCAB = 544  # wider than the tokenizer, like a padded embedding: the extra ids are never allowed


@pytest.fixture(scope="module")
def compiler(tok):
    return llguidance_backend.LLGuidanceCompiler(tok, VOCAB)


def allowed(bitmask_row: torch.Tensor) -> set[int]:
    return {t for t in range(VOCAB) if (int(bitmask_row[t // 32]) >> (t % 32)) & 1}


def test_the_plugin_is_installed_under_its_entry_point():
    backend = load_registry().get("guided_decoding", "llguidance")
    assert backend.factory is llguidance_backend.LLGuidanceCompiler


def test_literals_reference_added_tokens_by_id():
    special = SpecialTokens({"<tool_call>": 7, "<tool": 9})
    assert special.literal('a<tool_call>\n"x"') == '"a" <[7]> "\\n\\"x\\""'
    assert special.literal("<tool>") == "<[9]> \">\""
    assert special.literal("") == '""'


def test_masks_allow_exactly_the_guide_and_end_of_sequence_when_done(compiler, tok):
    m = compiler.matcher(GuideSpec("choice", ["yes", "no"]))
    bitmask = torch.zeros(2, (VOCAB + 31) // 32, dtype=torch.int32)
    compiler.fill_bitmask([m], bitmask, parallel=False)
    first = allowed(bitmask[0])
    assert first == {t for t in range(tok.vocab_size) if tok.token_bytes(t) and
                     any(w.startswith(tok.token_bytes(t)) for w in (b"yes", b"no"))}
    assert not allowed(bitmask[1])  # rows past the matchers are left alone
    for t in tok.encode("yes"):
        assert m.consume_token(t)
    assert m.is_stopped()
    fresh = compiler.matcher(GuideSpec("choice", ["yes", "no"]))
    compiler.fill_bitmask([m, fresh], bitmask, parallel=True)  # the rows on the backend's thread pool
    assert allowed(bitmask[0]) == set(tok.eos_token_ids) and allowed(bitmask[1]) == first
    with pytest.raises(ValueError):
        compiler.fill_bitmask([m], bitmask.to(torch.int64), parallel=False)


def test_compiled_guides_are_cached_by_kind_and_value(compiler, monkeypatch):
    calls = []
    real = llguidance_backend.grammar_for
    monkeypatch.setattr(llguidance_backend, "grammar_for",
                        lambda spec, special: calls.append(spec) or real(spec, special))
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}}
    a = compiler.matcher(GuideSpec("json_schema", schema, param="p1"))
    b = compiler.matcher(GuideSpec("json_schema", dict(schema), param="p2"))
    assert len(calls) == 1 and a is not b  # one compile, independent matchers
    assert a.consume_token(compiler.tokenizer.tokenize_str("{")[0]) and not b.is_stopped()
    reordered = {**schema, "properties": {"b": schema["properties"]["b"], "a": schema["properties"]["a"]}}
    compiler.matcher(GuideSpec("json_schema", reordered))  # property order matters to the output
    compiler.matcher(GuideSpec("lark", 'start: "x"'))
    compiler.matcher(GuideSpec("ebnf", 'start: "x"'))  # same text, other kind
    assert len(calls) == 4


def test_json_layout_is_one_line_unless_the_schema_asks(compiler, tok):
    m = compiler.matcher(GuideSpec("json_schema", {"type": "object", "properties": {"a": {"type": "integer"}}}))
    assert m.try_consume_tokens(tok.encode('{"a": 1}')) == len(tok.encode('{"a": 1}'))
    spaced = compiler.matcher(GuideSpec("json_schema", {"type": "object", "x-guidance": {"whitespace_flexible": True}}))
    text = '{\n  "a": 1\n}'
    assert spaced.try_consume_tokens(tok.encode(text)) == len(tok.encode(text))


def test_apply_token_mask_matches_a_reference():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 70, generator=g)
    allow = torch.rand(2, 70, generator=g) > 0.5
    bitmask = torch.zeros(2, 3, dtype=torch.int64)
    for r in range(2):
        for t in allow[r].nonzero().flatten().tolist():
            bitmask[r, t // 32] |= 1 << (t % 32)
    bitmask = (bitmask - (bitmask >= 2**31).long() * 2**32).to(torch.int32)  # two's complement
    out = apply_token_mask(logits, TokenMask(torch.tensor([0, 2]), bitmask))
    assert torch.equal(out[1], logits[1])
    for row, r in ((0, 0), (2, 1)):
        assert torch.equal(out[row][allow[r]], logits[row][allow[r]])
        assert torch.isneginf(out[row][~allow[r]]).all()


class _Matcher:
    """Accepts tokens from a set; stops after ``stop_after`` tokens."""

    def __init__(self, ok=frozenset(range(100)), stop_after=99):
        self.ok, self.stop_after, self.seen = ok, stop_after, []

    def consume_token(self, t):
        self.seen.append(t)
        return t in self.ok

    def is_stopped(self):
        return len(self.seen) >= self.stop_after

    def get_error(self):
        return "token not allowed\nstate dump"


MARKERS = ReasoningMarkers(start_id=200, end_id=201, separator=(202, 203))


def test_the_guide_waits_for_reasoning_and_its_separator():
    m = _Matcher()
    st = GuidedState(m, Phase.MAY_OPEN, MARKERS)
    assert st.masked and st.extra_token == 200
    st.on_token(200)
    assert st.phase is Phase.REASONING and not st.masked and st.extra_token is None
    st.on_token(5)
    st.on_token(201)
    assert st.owed() == [202, 203] and not st.masked
    st.on_token(202)
    assert st.owed() == [203]
    st.on_token(203)
    assert st.phase is Phase.ACTIVE and st.owed() == [] and m.seen == []
    st.on_token(7)
    assert m.seen == [7] and not st.finished


def test_reasoning_drafts_end_with_the_close_marker_and_nothing_past_it_commits():
    st = GuidedState(_Matcher(), Phase.REASONING, MARKERS, end_ids=(99,))
    assert st.verifiable([5, 6, 201, 7]) == 3  # the marker is verified, what follows is not
    assert st.verifiable([5, 99, 6]) == 2  # end-of-sequence too (banned here, never accepted)
    assert st.verifiable([5, 6]) == 2
    assert st.committable([5, 201, 7]) == 2  # the separator, not the sampled 7, follows the marker
    assert st.committable([5, 6, 201]) == 3


def test_guide_state_edge_cases():
    m = _Matcher(stop_after=1)
    st = GuidedState(m, Phase.MAY_OPEN, MARKERS)
    st.on_token(9)  # the first token did not open reasoning: it is the answer's
    assert m.seen == [9] and st.finished
    m = _Matcher()
    st = GuidedState(m, Phase.REASONING, MARKERS)
    st.on_token(201)
    st.on_token(8)  # not the separator: the answer starts here
    assert st.phase is Phase.ACTIVE and m.seen == [8]
    st = GuidedState(_Matcher(ok=frozenset()), Phase.ACTIVE, None)
    with pytest.raises(GuideRejectedError, match="rejected token 3: token not allowed$"):
        st.on_token(3)


def test_markers_and_the_starting_phase(tok):
    markers = ReasoningMarkers.from_parser(QWEN3, tok)
    start, end = tok.token_to_id("<think>"), tok.token_to_id("</think>")
    assert markers == ReasoningMarkers(start, end, tuple(tok.encode("\n\n")))
    closed = tok.encode(tok.apply_chat_template([{"role": "user", "content": "q"}], enable_thinking=False))
    fresh = tok.encode(tok.apply_chat_template([{"role": "user", "content": "q"}], enable_thinking=True))
    assert markers.initial_phase(closed, thinking=True) is Phase.ACTIVE
    assert markers.initial_phase(fresh, thinking=True) is Phase.MAY_OPEN
    assert markers.initial_phase(fresh, thinking=False) is Phase.ACTIVE
    assert markers.initial_phase(fresh + [start, 5], thinking=False) is Phase.REASONING
    assert markers.initial_phase(fresh + [start, 5, end], thinking=True) is Phase.ACTIVE
    assert ReasoningMarkers.from_parser(attrs.evolve(QWEN3, name="x", end="</reasoning here>"), tok) is None


def test_masks_add_the_reasoning_opener_while_it_may_come(compiler, tok):
    masks = GuidedMasks(compiler, VOCAB, torch.device("cpu"))
    start = tok.token_to_id("<think>")
    markers = ReasoningMarkers(start, tok.token_to_id("</think>"), ())
    masks.track(10, GuidedState(compiler.matcher(GuideSpec("regex", "[ab]")), Phase.MAY_OPEN, markers))
    masks.track(11, GuidedState(compiler.matcher(GuideSpec("regex", "[ab]")), Phase.ACTIVE, markers))
    masks.track(12, GuidedState(compiler.matcher(GuideSpec("regex", "[ab]")), Phase.REASONING, markers))
    assert masks.masks([99]) is None  # unguided rows are never masked
    reasoning = masks.masks([12, 99])  # reasoning rows are not masked; only their stops wait
    assert reasoning.rows is None and reasoning.hold_stops == {0}
    mask = masks.masks([99, 11, 10, 12])  # more rows than the initial buffer holds
    assert mask.rows.tolist() == [1, 2] and mask.hold_stops == {3}
    ab = {tok.encode("a")[0], tok.encode("b")[0]}
    assert allowed(mask.bitmask[0]) == ab and allowed(mask.bitmask[1]) == ab | {start}
    masks.forget(10)
    assert masks.masks([10]) is None and len(masks) == 2


def test_profile_option_selects_the_backend(tok):
    args = build_parser().parse_args(["--guided-backend", "none"])
    assert overrides_from_args(args) == {"guided.backend": "none"}
    registry = load_registry()
    assert check_selections(load_profile(model="m", overrides={"guided_backend": "none"}), registry) == []
    errors = check_selections(load_profile(model="m", overrides={"guided_backend": "xgrammar"}), registry)
    assert errors == ["guided.backend: no plugin provides guided_decoding 'xgrammar' (available: llguidance)"]
    family = SimpleNamespace(reasoning_parser="qwen3")
    off = load_profile(model="m", overrides={"guided_backend": "none"})
    assert build_guided_decoding(off, registry, tok, family, VOCAB) is None
    built = build_guided_decoding(load_profile(model="m"), registry, tok, family, VOCAB)
    assert built.compiler.name == "llguidance" and built.markers.end_id == tok.token_to_id("</think>")
    bare = PluginRegistry()  # the default backend is not installed: guided decoding is off
    assert build_guided_decoding(load_profile(model="m"), bare, tok, family, VOCAB) is None


def test_batch_guides_become_specs_with_their_json_path():
    assert guide_spec({"choice": '["a", "b"]'}, "requests[3].guided_decoding") == GuideSpec(
        "choice", ["a", "b"], "requests[3].guided_decoding.choice")
    assert guide_spec({"json_schema": '{"type": "string"}'}, "guided_decoding").value == {"type": "string"}
    assert guide_spec({"structural_tag": {"triggers": []}}, "g").value == {"triggers": []}
    assert guide_spec({"json_object": True}, "g") == GuideSpec("json_object", None, "g.json_object")
    assert guide_spec({"regex": "[0-9]+"}, "g").value == "[0-9]+"
