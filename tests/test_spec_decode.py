"""Speculative rounds in the engine: greedy output is the same with and without speculation.

The proposer here replays the plain run's own output with a deliberate mistake every few
tokens, so every round length occurs: all drafts kept, a rejection at each position, and
rows padded into a wider row's verify step. That exercises acceptance, the KV and
recurrent-state rollback (hybrid families), chunked prefill beside verify rows, and
prefix reuse across turns, on every family.
"""

from __future__ import annotations

import pytest

from ninfer import LLM, SamplingParams
from ninfer.engine.stats import ContextCacheCounters
from ninfer_plugins.speculative.ngram import NgramProposer

FAMILIES = ["qwen3", "qwen3_moe", "qwen3_next", "qwen3_5", "qwen3_5_moe"]
PROMPTS = ["one two three four one two three", "abc abc abc", "the cat sat on the mat and then the", "x"]
SETTINGS = dict(dtype="fp32", device="cpu", max_concurrency=4, prefill_chunk=8, block_size=4, max_context=256)


class ReplayProposer:
    """Drafts the reference continuation of each prompt; draft ``i`` of a round is wrong when
    ``(position + i) % period == 0``, so rounds stop at varying positions."""

    needs_hidden = False

    def __init__(self, reference: dict[tuple[int, ...], list[int]], period: int = 5):
        self.reference, self.period = reference, period

    def after_step(self, record) -> None:
        pass

    def propose(self, seq, limit: int) -> list[int]:
        prompt = tuple(seq.token_ids[: seq.num_prompt_tokens])
        done = seq.num_output_tokens
        future = self.reference.get(prompt, [])[done:done + limit]  # other prompts: no drafts
        return [(t + 1) % 64 if (done + i) % self.period == 0 else t for i, t in enumerate(future)]


def _run(llm, prompts, params):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


@pytest.fixture(scope="module", params=FAMILIES)
def pair(request):
    model = f"tiny:{request.param}"
    return LLM(model, **SETTINGS), LLM(model, spec="ngram", draft_tokens=3, **SETTINGS)


def test_greedy_with_speculation_equals_without(pair):
    plain, spec = pair
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    expected = _run(plain, PROMPTS, params)
    tok = plain.get_tokenizer()
    spec.engine.proposer = ReplayProposer({tuple(tok.encode(p)): out for p, out in zip(PROMPTS, expected)})
    stats = spec.engine.stats
    assert _run(spec, PROMPTS, params) == expected
    assert stats.total_rounds > 0 and 0 < stats.total_accepted < stats.total_drafted  # kept and rejected
    assert spec.engine.block_manager.num_used_blocks == 0 or not spec.engine.has_unfinished()


def _second_turn(plain, spec, between: str = ""):
    """Two greedy turns of one conversation on ``plain``, then on ``spec`` with its drafts
    replaying them (``between``: a prompt run on ``spec`` between the turns); returns
    ``spec``'s second turn and the tokens ``plain`` gave it."""
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    tok = plain.get_tokenizer()
    first = tok.encode("a long shared opening line for two turns of talk")
    turn1 = _run(plain, [first], params)[0]
    second = first + turn1 + tok.encode(" and then")
    turn2 = _run(plain, [second], params)[0]
    spec.engine.proposer = ReplayProposer({tuple(first): turn1, tuple(second): turn2}, period=3)
    assert _run(spec, [first], params)[0] == turn1
    if between:
        spec.generate([between], params)
    return spec.generate([second], params)[0], turn2


def test_prefix_reuse_across_turns_with_speculation(pair):
    """A second turn resumes from the first turn's cached pages and (hybrids) state snapshots."""
    out, expected = _second_turn(*pair)
    assert out.outputs[0].token_ids == expected
    assert out.num_cached_tokens > 0


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
def test_host_tiers_with_speculation(family):
    """A second turn whose first turn's pages (and, for a hybrid, its state snapshots) were
    pushed out to the host tiers resumes from them with speculation on, token for token."""
    small = {**SETTINGS, "max_concurrency": 1, "max_context": 64, "kv_capacity": 64}
    tiers = dict(host_kv_mib=16, host_state_slots=8 if family == "qwen3_5" else None)
    spec = LLM(f"tiny:{family}", spec="ngram", draft_tokens=3, **tiers, **small)
    out, expected = _second_turn(LLM(f"tiny:{family}", **small), spec,
                                 between="something else entirely, to push the first turn out of the pool")
    counters = ContextCacheCounters.of(spec.engine.scheduler)
    assert out.outputs[0].token_ids == expected and out.num_cached_tokens > 0
    assert counters.spilled_pages > 0 and counters.restored_pages > 0
    if family == "qwen3_5":
        assert counters.snapshot_host_hits > 0
    assert spec.engine.stats.total_accepted > 0


def test_seeded_sampling_does_not_depend_on_the_batch(pair):
    _, spec = pair
    spec.engine.proposer = NgramProposer(min_n=1)
    params = SamplingParams(temperature=0.8, top_k=20, seed=7, max_tokens=16, ignore_eos=True)
    alone = _run(spec, [PROMPTS[0]], params)
    together = _run(spec, PROMPTS, [params] + [SamplingParams(temperature=1.0, seed=i, max_tokens=16)
                                               for i in range(len(PROMPTS) - 1)])
    assert together[0] == alone[0]


def test_request_timings_count_drafts_and_the_throughput_line_reports_rounds(pair):
    from ninfer.engine.request import EngineRequest

    plain, spec = pair
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    expected = _run(plain, [PROMPTS[1]], params)[0]
    tok = plain.get_tokenizer()
    spec.engine.proposer = ReplayProposer({tuple(tok.encode(PROMPTS[1])): expected}, period=3)
    spec.engine.add_request(EngineRequest("t", tok.encode(PROMPTS[1]), params))
    events = []
    while spec.engine.has_unfinished():
        events += spec.engine.step()
    timings = events[-1].timings
    assert timings.draft_tokens > timings.draft_accepted > 0
    assert sum(len(e.token_ids) for e in events) == 10
    interval = spec.engine.stats.take_interval()
    assert interval.rounds > 0 and interval.acceptance_length > 1
    assert len(interval.position_acceptance) == 3 and all(0 <= a <= 1 for a in interval.position_acceptance)


def test_a_request_may_opt_out_of_speculation(pair):
    from ninfer.engine.request import EngineRequest

    plain, spec = pair
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    tok = plain.get_tokenizer()
    expected = _run(plain, [PROMPTS[2]], params)[0]
    spec.engine.proposer = ReplayProposer({tuple(tok.encode(PROMPTS[2])): expected})
    spec.engine.add_request(EngineRequest("o", tok.encode(PROMPTS[2]), params, speculate=False))
    events = []
    while spec.engine.has_unfinished():
        events += spec.engine.step()
    assert [t for e in events for t in e.token_ids] == expected
    assert events[-1].timings.draft_tokens == 0


def test_ngram_proposes_what_followed_the_latest_match():
    class Seq:
        token_ids = [1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 1, 2, 3]

    assert NgramProposer().propose(Seq, 3) == [7, 8, 5]  # the latest earlier "1 2 3"
    Seq.token_ids = [4, 5, 6]
    assert NgramProposer().propose(Seq, 3) == []


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
def test_the_verify_graphs_inputs_give_the_eager_verify_rows(family):
    """What a replayed verify graph computes, run eagerly on its staged (padded) inputs:
    the same hidden rows as the eager verify step, and the same per-position state."""
    import torch

    from ninfer.engine.scheduler import ScheduledChunk, SchedulerOutput
    from ninfer.engine.spec.verify_graphs import VerifyGraphs

    llm = LLM(f"tiny:{family}", spec="ngram", draft_tokens=3, **SETTINGS)
    engine, tok = llm.engine, llm.get_tokenizer()
    from ninfer.engine.request import EngineRequest

    for i, prompt in enumerate(PROMPTS[:3]):  # prefill, and one token each, so all three decode
        engine.add_request(EngineRequest(f"g{i}", tok.encode(prompt), SamplingParams(temperature=0, max_tokens=30,
                                                                                   ignore_eos=True), speculate=False))
    while engine.scheduler.num_decode_ready < 3:
        engine.step()
    seqs = engine.scheduler.running[:3]
    drafts = [(5, 6, 7), (8,), (9, 10, 11)]
    sched = SchedulerOutput([ScheduledChunk(s, 1 + len(d), True, d) for s, d in zip(seqs, drafts)], num_decode=3,
                            num_verify=3)
    scratch = engine.runner.scratch
    states = [t.clone() for t in llm.engine.model.state_tensors()] if scratch is not None else []
    ids, pos, batch = engine.runner.build_batch(sched)
    eager = engine.model(ids, pos, batch)
    eager_state = [t.clone() for t in engine.model.state_tensors()]
    for t, saved in zip(engine.model.state_tensors(), states):
        t.copy_(saved)
    graphs = VerifyGraphs(engine.model, 4, 4, 256, 4, torch.device("cpu"), scratch)
    ids_list = [t for s, d in zip(seqs, drafts) for t in ([s.token_ids[-1], *d] + [d[-1]] * (3 - len(d)))]
    bucket = graphs.stage_inputs(ids_list, [s.num_computed_tokens for s in seqs], [s.block_table for s in seqs],
                                 [s.state_slot for s in seqs] if scratch is not None else None)
    staged = graphs.forward_staged(bucket)[:12]
    torch.testing.assert_close(staged, eager, rtol=1e-5, atol=1e-5)
    if scratch is not None:  # every real row's per-position state agrees (the trash row may differ)
        real = [scratch.row(s.state_slot, t) for s in seqs for t in range(4)]
        for a, b in zip(engine.model.state_tensors(), eager_state):
            torch.testing.assert_close(a[real], b[real])


def test_the_lm_head_draft_proposes_only_shortlisted_tokens_and_stays_lossless(tmp_path_factory):
    import json
    import shutil

    from ninfer.tiny.make import make_tiny

    model = make_tiny(tmp_path_factory.mktemp("tiny-shortlist"), "qwen3_5", seed=0)
    settings = {**SETTINGS, "spec": "mtp", "draft_tokens": 2}
    with pytest.raises(ValueError, match="lm_head_shortlist.json"):
        LLM(str(model), lm_head_draft=True, **settings)
    shortlist = list(range(40, 90))  # a shortlist of 50 ids
    (model / "lm_head_shortlist.json").write_text(json.dumps(
        {"format": "ninfer-lm-head-shortlist", "version": 1, "token_ids": shortlist, "special_token_ids": []}))
    spec = LLM(str(model), lm_head_draft=True, lm_head_draft_size=20, **settings)
    seen = []
    proposer = spec.engine.proposer
    propose = proposer.propose
    proposer.propose = lambda seq, limit: seen.extend(out := propose(seq, limit)) or out
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    plain = LLM(str(model), **SETTINGS)
    assert _run(spec, PROMPTS, params) == _run(plain, PROMPTS, params)
    assert seen and set(seen) <= set(shortlist[:20])
    shutil.rmtree(model)


def test_logprob_rows_decode_plainly_beside_verify_rows_and_guided_rows_speculate(pair):
    """Rows asking for log probabilities may not speculate: they share verify steps with
    rows that do, keeping their log probabilities; a guided row speculates, its verify rows
    masked by its guide (tests/test_spec_guided.py goes further). Every output equals the
    plain engine's."""
    from ninfer.engine.request import EngineRequest
    from ninfer.guided.spec import GuideSpec

    plain, spec = pair
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    guided = SamplingParams(temperature=0, max_tokens=16, guided=GuideSpec("regex", r"[a-z]+( [a-z]+){2,5}\."))
    scored = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)
    params = [greedy, guided, scored, greedy]
    expected = plain.generate(PROMPTS, params)
    tok = plain.get_tokenizer()
    spec.engine.proposer = ReplayProposer({tuple(tok.encode(p)): o.outputs[0].token_ids
                                           for p, o in zip(PROMPTS, expected)}, period=4)
    for i, (prompt, p) in enumerate(zip(PROMPTS, params)):
        spec.engine.add_request(EngineRequest(f"m{i}", tok.encode(prompt), p))
    ids, lps, timings = {}, {}, {}
    while spec.engine.has_unfinished():
        for ev in spec.engine.step():
            ids.setdefault(ev.request_id, []).extend(ev.token_ids)
            lps.setdefault(ev.request_id, []).extend(lp.token_id for lp in ev.logprobs or ())
            if ev.finished:
                timings[ev.request_id] = ev.timings
    assert [ids[f"m{i}"] for i in range(4)] == [o.outputs[0].token_ids for o in expected]
    assert lps["m2"] == [p.token_id for p in expected[2].outputs[0].logprobs]
    assert timings["m2"].draft_tokens == 0
    assert all(timings[f"m{i}"].draft_tokens > 0 for i in (0, 1, 3))


def test_mtp_proposes_from_its_own_distribution_for_sampled_requests():
    """"auto" draws sampled requests' drafts from the head's distribution and verifies with
    that q; seeded outputs stay independent of the batch, and greedy requests stay exact."""
    spec = LLM("tiny:qwen3_5", spec="mtp", draft_tokens=3, **SETTINGS)
    sampled = SamplingParams(temperature=0.9, top_k=8, seed=11, max_tokens=12, ignore_eos=True)
    seen = []
    probs = spec.engine.proposer.draft_probs
    spec.engine.proposer.draft_probs = lambda seq: seen.append(q := probs(seq)) or q
    alone = _run(spec, [PROMPTS[0]], sampled)
    assert seen and all(q is not None and q.shape[0] == 3 for q in seen)
    assert all(torch_close(q.sum(-1), 1.0) for q in seen)
    mixed = _run(spec, PROMPTS, [sampled] + [SamplingParams(temperature=0.5, seed=i, max_tokens=12)
                                             for i in range(len(PROMPTS) - 1)])
    assert mixed[0] == alone[0]
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    assert _run(spec, PROMPTS, greedy) == _run(LLM("tiny:qwen3_5", **SETTINGS), PROMPTS, greedy)


def torch_close(values, target: float) -> bool:
    return bool(((values - target).abs() < 1e-4).all())


@pytest.mark.parametrize("slack", [True, False])
def test_rows_near_the_end_of_their_budget_keep_to_verify_steps(pair, slack, monkeypatch):
    """Prompt plus output filling their pages exactly. With the speculative slack pages a
    row keeps taking the padding of a wider neighbour's verify row up to its last token
    (with nothing left to propose, as a row without drafts), so no step mixes plain decode
    rows with verify rows (such a step runs eagerly on the GPU). Without the slack (a
    request that only fits the pool without it) a row close to its end decodes plainly
    beside them. Outputs stay exact either way."""
    plain, spec = pair
    prompts = [list(range(5, 10)), list(range(40, 48))]  # 5 and 8 tokens, each + max_tokens = 5 pages of 4
    params = [SamplingParams(temperature=0, max_tokens=15, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)]
    expected = _run(plain, prompts, params)
    spec.engine.proposer = ReplayProposer({tuple(p): out for p, out in zip(prompts, expected)}, period=3)
    scheduler, steps = spec.engine.scheduler, []
    schedule, add = scheduler.schedule, scheduler.add

    def recorded(drafts=None):
        out = schedule(drafts)
        steps.append((out.num_verify, out.num_decode))
        return out

    def added(seq):
        seq.spec_slack = seq.spec_slack if slack else 0
        add(seq)

    monkeypatch.setattr(scheduler, "schedule", recorded)
    monkeypatch.setattr(scheduler, "add", added)
    assert _run(spec, prompts, params) == expected
    mixed = [s for s in steps if 0 < s[0] < s[1]]
    assert (not mixed) if slack else mixed


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"])
def test_the_mtp_draft_graphs_staged_inputs_give_the_eager_drafts(family):
    """What a replayed MTP drafting graph computes, run eagerly on its staged inputs, equals
    the eager drafting after every decode-shaped step (plain decode and verify rows)."""
    spec = LLM(f"tiny:{family}", spec="mtp", draft_tokens=3, **SETTINGS)
    proposer = spec.engine.proposer
    graphs = proposer.make_graphs()
    eager = proposer.after_step
    compared, failures = [], []

    def checked(record):
        eager(record)
        live = [(c.seq, s, f, n) for c, s, f, n in zip(record.chunks, record.starts, record.row_starts, record.kept)
                if not c.seq.is_finished and n > 0]
        if not live or any(n > graphs.width for *_, n in live):
            return
        bucket = graphs.stage([q for q, *_ in live], [s for _, s, _, _ in live], [n for *_, n in live],
                              record.hidden, [f for _, _, f, _ in live])
        chained = [[s + n + j for _, s, _, n in live] for j in range(graphs.k - 1)]
        if graphs.chain_pos[:, : len(live)].tolist() != chained:  # where each chained draft sits
            failures.append(("chain positions", graphs.chain_pos.tolist(), chained))
        drafts = graphs.forward_staged(bucket, len(live)).tolist()
        for (seq, *_), row in zip(live, drafts):
            if seq.is_decode:
                if row != proposer._drafts[seq.seq_id]:
                    failures.append(("drafts", row, proposer._drafts[seq.seq_id]))
                compared.append(row)

    # (the engine survives a proposer's exception by logging it, so failures are collected)
    proposer.after_step = checked
    _run(spec, PROMPTS, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    _run(spec, PROMPTS[2:], SamplingParams(temperature=0, max_tokens=7, ignore_eos=True))  # a smaller bucket
    assert not failures, failures[:3]
    assert len(compared) > 20


def test_speculative_slack_stops_at_the_context_and_skips_requests_that_opt_out(pair):
    """The slack covers the draft count past the output budget, but never positions past
    the context (the position tables end there); a request that does not speculate has none."""
    from ninfer.engine.request import EngineRequest

    _, spec = pair
    engine, prompt = spec.engine, list(range(5, 10))  # max_context 256
    cases = {"room": (20, True, 3), "one short": (250, True, 1), "full": (251, True, 0), "opted out": (20, False, 0)}
    for name, (max_tokens, speculate, _) in cases.items():
        engine.add_request(EngineRequest(name, prompt, SamplingParams(temperature=0, max_tokens=max_tokens),
                                         speculate=speculate))
    try:
        assert {name: engine._requests[name].seq.spec_slack for name in cases} == {n: c[2] for n, c in cases.items()}
    finally:
        for name in cases:
            engine.abort_request(name)
    assert not engine.has_unfinished()
