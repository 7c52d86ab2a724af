"""Guided requests speculate, and their output is exactly the plain engine's.

The proposers here know nothing of grammars, as real ones do not: they replay the plain
run's output with wrong tokens every few positions, alternately one the guide refuses (a
control character, which neither the regexes nor JSON take) and a plausible one, and
they keep proposing past the end of the answer. So the engine must cut drafts at a
refused token and at the guide's end, mask every verify row with the guide's state
there, hold stop tokens while the guide cannot end, stop drafting before a reasoning
close marker and commit the separator after it.
"""

from __future__ import annotations

import itertools
import json
import re

import pytest
import torch

from ninfer import LLM, SamplingParams
from ninfer.engine.request import EngineRequest
from ninfer.engine.spec.distribution import processed_distribution
from ninfer.guided.spec import GuideSpec

SETTINGS = dict(dtype="fp32", device="cpu", max_concurrency=6, prefill_chunk=8, block_size=4, max_context=256)
WORDS = r"[a-z]+( [a-z]+){2,5}\."
SHORT_WORDS = r"[a-z]{2,6}( [a-z]{2,6}){2}\."
CITY = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city", "days"]}
ANSWER = r"[a-z]{3,8}"
MAX_DRAFTS = 3  # the engines' draft_tokens
#: a bias on the reasoning close marker under which greedy reasoning closes after a few
#: tokens (found by scanning; the tiny families differ)
CLOSE_BIAS = {"qwen3": 4.5, "qwen3_moe": 1.0, "qwen3_5": 1.5, "qwen3_5_moe": 1.5}


class ReplayProposer:
    """Drafts each prompt's reference continuation, then more of its last token; the draft
    at output position p is wrong when ``p % period == 0``: alternately ``bad`` and the
    token after the right one."""

    needs_hidden = False

    def __init__(self, reference: dict[tuple[int, ...], list[int]], bad: int, period: int = 5):
        self.reference, self.bad, self.period = reference, bad, period
        self.proposed = 0

    def after_step(self, record) -> None:
        pass

    def _future(self, seq, limit: int) -> list[int]:
        ref = self.reference.get(tuple(seq.token_ids[: seq.num_prompt_tokens]), [])
        done = seq.num_output_tokens
        return (ref + ref[-1:] * limit)[done:done + limit] if ref else []

    def propose(self, seq, limit: int) -> list[int]:
        done = seq.num_output_tokens
        out = [self._wrong(done + i, t) if (done + i) % self.period == 0 else t
               for i, t in enumerate(self._future(seq, limit))]
        self.proposed += len(out)
        return out

    def _wrong(self, position: int, token: int) -> int:
        return self.bad if (position // self.period) % 2 else (token + 1) % 64


class TargetProposer(ReplayProposer):
    """The target itself as the draft: a seeded plain run's tokens (stream-0 draws from
    the target's p, as a draft's proposals are) with the p each was drawn from as q."""

    def __init__(self, reference, probs: dict[tuple[int, int], torch.Tensor]):
        super().__init__(reference, bad=0, period=10**9)
        self.probs = probs

    def draft_probs(self, seq):
        """q of the drafts from this position on (the engine reads as many rows as it kept
        drafts); a position with no p was forced (the separator after reasoning) or lies
        past the run, and drafts never reach it."""
        rows: list[torch.Tensor] = []
        while len(rows) < MAX_DRAFTS and (p := self.probs.get((seq.sampling.seed, seq.num_output_tokens + len(rows)))) \
                is not None:
            rows.append(p)
        return torch.stack(rows) if rows else None


class RecordingSampler:
    """Wraps the plain engine's sampler, keeping the processed p of every sampled row by
    (seed, output position)."""

    def __init__(self, sampler):
        self.sampler, self.probs = sampler, {}

    def __call__(self, logits, meta):
        dist = processed_distribution(logits.float(), meta)
        for r in range(meta.num_rows):
            self.probs[(int(meta.seeds[r]), int(meta.positions[r]))] = dist.probs[r].clone()
        return self.sampler(logits, meta)


_ids = itertools.count()


def run(llm, requests: list[tuple[list[int], SamplingParams, bool]]) -> list[dict]:
    """Step the engine over (prompt ids, params, thinking) requests: per request its token
    ids, text, finish reason and timings."""
    engine = llm.engine
    names = [f"r{next(_ids)}" for _ in requests]
    for name, (prompt, params, thinking) in zip(names, requests):
        engine.add_request(EngineRequest(name, list(prompt), params, thinking=thinking))
    out = {name: {"ids": [], "text": "", "finish": None, "timings": None, "error": None} for name in names}
    while engine.has_unfinished():
        for ev in engine.step():
            o = out[ev.request_id]
            o["ids"] += ev.token_ids
            o["text"] += ev.text
            if ev.finished:
                o["finish"], o["timings"], o["error"] = ev.finish_reason, ev.timings, ev.error
    assert [out[n]["error"] for n in names] == [None] * len(names)
    return [out[n] for n in names]


def reasoning_prompt(tok, content: str) -> list[int]:
    text = tok.apply_chat_template([{"role": "user", "content": content}], enable_thinking=True)
    return tok.encode(text + "<think>\n")


@pytest.fixture(scope="module", params=list(CLOSE_BIAS))
def pair(request):
    model = f"tiny:{request.param}"
    return request.param, LLM(model, **SETTINGS), LLM(model, spec="ngram", draft_tokens=MAX_DRAFTS, **SETTINGS)


def bad_token(tok) -> int:
    """A token no guide here accepts anywhere (a control character)."""
    (bad,) = tok.encode("\x01")
    return bad


def test_verify_masks_are_the_plain_masks_after_each_draft(pair):
    """Row j of a guided verify row is masked exactly as the plain path masks the position
    once drafts 0..j-1 are committed; the matcher is left where it was."""
    from types import SimpleNamespace

    from ninfer.engine.guided_masks import GuidedMasks
    from ninfer.engine.guided_state import GuidedState, Phase

    _, plain, _ = pair
    tok, guided, vocab = plain.get_tokenizer(), plain.engine.guided, plain.engine.vocab_size
    compiler = guided.compiler
    drafts = tok.encode("ab c.")  # completes the guide after "ab c" with the period
    state = GuidedState(compiler.matcher(GuideSpec("regex", r"[a-z]+ [a-z]+\.")), Phase.ACTIVE, None, guided.end_ids)
    assert state.verifiable(drafts + [bad_token(tok)]) == len(drafts)  # cut after the guide's end
    # a refused draft ends the drafts and is verified (its mask refuses it): the cut may not
    # depend on a draft that is not verified
    assert state.verifiable([drafts[0], bad_token(tok), drafts[1]]) == 2
    assert state.verifiable([bad_token(tok)]) == 1
    assert state.committable(drafts) == len(drafts)  # only reasoning drops tokens
    masks = GuidedMasks(compiler, vocab, torch.device("cpu"))
    masks.track(7, state)
    width = len(drafts) + 2  # wider than the row: padding rows stay unmasked
    other = SimpleNamespace(seq=SimpleNamespace(seq_id=8), drafts=(1,))  # unguided, first in the step
    got = masks.verify_masks([other, SimpleNamespace(seq=SimpleNamespace(seq_id=7), drafts=tuple(drafts))], width)
    assert got.rows.tolist() == [width + j for j in range(len(drafts) + 1)]
    assert got.hold_stops == {width + j for j in range(len(drafts))}  # it can end only after the period
    shadow = GuidedState(compiler.matcher(GuideSpec("regex", r"[a-z]+ [a-z]+\.")), Phase.ACTIVE, None, guided.end_ids)
    reference = GuidedMasks(compiler, vocab, torch.device("cpu"))
    reference.track(0, shadow)
    for j in range(len(drafts) + 1):
        assert torch.equal(got.bitmask[j], reference.masks([0]).bitmask[0]), j
        if j < len(drafts):
            shadow.on_token(drafts[j])
    assert state.matcher.validate_tokens(drafts) == len(drafts) and not state.matcher.is_stopped()


def test_greedy_guided_output_with_speculation_equals_without(pair):
    check_greedy_guided(*pair)


def check_greedy_guided(family: str, plain: LLM, spec: LLM) -> None:
    """Greedy guided requests (regex, JSON schema, thinking on, held stops) beside an
    unguided one give the plain engine's tokens, every one of them speculating."""
    tok = plain.get_tokenizer()
    end_id = tok.token_to_id("</think>")
    (stop,) = tok.encode("a")  # a token the guide allows from the start
    greedy = dict(temperature=0, max_tokens=40)
    requests = [
        (tok.encode("the cat sat on the mat and then the"), SamplingParams(**greedy, guided=GuideSpec("regex", WORDS)),
         False),
        (tok.encode("weather in paris"), SamplingParams(**greedy, guided=GuideSpec("json_schema", CITY)), False),
        (tok.encode("abc abc abc"), SamplingParams(**greedy, ignore_eos=True), False),  # unguided, beside them
        # thinking on: free reasoning the model closes after a few tokens, then the guide
        (reasoning_prompt(tok, "one two three"),
         SamplingParams(**greedy, logit_bias={end_id: CLOSE_BIAS[family]}, guided=GuideSpec("regex", ANSWER)), True),
        # stop tokens the model wants at once wait while reasoning and until the guide can end
        (reasoning_prompt(tok, "one two three"),
         SamplingParams(**greedy, logit_bias={end_id: CLOSE_BIAS[family], **{e: 100.0 for e in tok.eos_token_ids}},
                        guided=GuideSpec("regex", ANSWER)), True),
        (tok.encode("go on"), SamplingParams(**greedy, stop_token_ids=[stop], logit_bias={stop: 100.0},
                                             guided=GuideSpec("regex", ANSWER)), False),
    ]
    expected = run(plain, requests)
    for e in expected[3:5]:
        assert end_id in e["ids"][2:], "precondition: reasoning closes inside a round"
        assert re.fullmatch(ANSWER, e["text"].partition("</think>\n\n")[2])
    assert expected[4]["ids"][-1] in tok.eos_token_ids and expected[5]["ids"][-1] == stop
    proposer = ReplayProposer({tuple(p): e["ids"] for (p, _, _), e in zip(requests, expected)}, bad_token(tok))
    spec.engine.proposer = proposer
    got = run(spec, requests)
    assert [g["ids"] for g in got] == [e["ids"] for e in expected]
    assert [g["finish"] for g in got] == [e["finish"] for e in expected]
    assert all(g["timings"].draft_accepted > 0 for g in got)  # every request speculated
    stats = spec.engine.stats
    assert stats.total_accepted < stats.total_drafted  # some wrong drafts were verified and rejected
    assert stats.total_drafted < proposer.proposed  # others were cut: refused, or past the guide's end


def test_a_guide_ending_mid_round_ends_the_request_there(pair):
    """Drafts run on past the answer (more of its last token): the round keeps the token
    that completes the guide and the request ends with it, as without speculation."""
    _, plain, spec = pair
    tok = plain.get_tokenizer()
    requests = [(tok.encode(p), SamplingParams(temperature=0, max_tokens=40, guided=g), False) for p, g in (
        ("pick one", GuideSpec("choice", ["alpha", "beta gamma"])),
        ("a sentence", GuideSpec("regex", SHORT_WORDS)),
    )]
    expected = run(plain, requests)
    assert all(e["finish"] == "stop" for e in expected)
    spec.engine.proposer = ReplayProposer({tuple(p): e["ids"] for (p, _, _), e in zip(requests, expected)},
                                          bad_token(tok), period=10**9)
    got = run(spec, requests)
    assert [(g["ids"], g["finish"]) for g in got] == [(e["ids"], e["finish"]) for e in expected]
    assert all(g["timings"].draft_tokens > 0 for g in got)


def test_seeded_sampling_with_the_target_as_draft_reproduces_plain_sampling(pair):
    """With q = p, every draft is accepted and the round's own token is the plain
    sampler's draw, so a seeded guided request commits the very tokens plain sampling
    does, reasoning, separator and answer; only if every verify row is masked (and its
    stops held) exactly as the plain path masks that position."""
    _, plain, spec = pair
    tok = plain.get_tokenizer()
    end_id = tok.token_to_id("</think>")
    prompt = reasoning_prompt(tok, "think, then answer")

    def thinking(seed: int) -> SamplingParams:
        return SamplingParams(temperature=1.0, seed=seed, max_tokens=48, logit_bias={end_id: 3.0},
                              guided=GuideSpec("regex", ANSWER))

    seed = next(s for s in range(16) if _closes_inside_a_round(run(plain, [(prompt, thinking(s), True)])[0], end_id))
    requests = [
        (prompt, thinking(seed), True),
        (tok.encode("weather in paris"),
         SamplingParams(temperature=0.8, top_k=40, seed=1000, max_tokens=48, guided=GuideSpec("json_schema", CITY)),
         False),
    ]
    recorder = RecordingSampler(plain.engine.runner.sampler)
    plain.engine.runner.sampler = recorder
    try:
        expected = run(plain, requests)
    finally:
        plain.engine.runner.sampler = recorder.sampler
    spec.engine.proposer = TargetProposer({tuple(p): e["ids"] for (p, _, _), e in zip(requests, expected)},
                                          recorder.probs)
    got = run(spec, requests)
    assert [g["ids"] for g in got] == [e["ids"] for e in expected]
    assert all(g["timings"].draft_accepted > 0 for g in got)


def _closes_inside_a_round(result: dict, end_id: int) -> bool:
    """Reasoning closed after the first tokens (a verify round may reach the marker) and
    the answer finished."""
    return end_id in result["ids"][2:] and result["finish"] == "stop"


def test_sampled_guided_output_satisfies_its_guide_whatever_the_drafts(pair):
    """Drafts follow the greedy guided answers (valid, but soon not what a sampled request
    writes) with refused tokens among them; every finished answer matches its guide."""
    _, plain, spec = pair
    tok = plain.get_tokenizer()
    prompts = [tok.encode(p) for p in ("one two three", "weather in paris", "zzz")]
    guides = [GuideSpec("regex", WORDS), GuideSpec("json_schema", CITY), GuideSpec("regex", ANSWER)]
    greedy = run(plain, [(p, SamplingParams(temperature=0, max_tokens=60, guided=g), False)
                         for p, g in zip(prompts, guides)])
    spec.engine.proposer = ReplayProposer({tuple(p): g["ids"] for p, g in zip(prompts, greedy)}, bad_token(tok), 3)
    requests = [(p, SamplingParams(temperature=1.0, seed=s, max_tokens=60, guided=g), False)
                for s in range(2) for p, g in zip(prompts, guides)]
    got = run(spec, requests)
    checks = [lambda t: re.fullmatch(WORDS, t), lambda t: set(json.loads(t)) == {"city", "days"},
              lambda t: re.fullmatch(ANSWER, t)] * 2
    assert spec.engine.stats.total_drafted > 0
    for g, check in zip(got, checks):
        if g["finish"] == "stop":
            assert check(g["text"]), g["text"]
