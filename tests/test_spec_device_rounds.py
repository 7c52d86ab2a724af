"""Greedy speculative rounds run whole on the device and launched ahead of their verdicts.

On CPU the rounds run eagerly on the same static inputs a CUDA graph would capture
(``LLM(..., decode_ahead_on_cpu=True)``), so what is checked here is the round's logic:
the verdict, the state settled from the scratch rows, the MTP drafting from device
tensors and the next round's inputs written over this one's. The model is the ``test``
preset of ``ninfer-train`` (its MTP head has learned something, so drafts are accepted
at every position, not only rejected as a random head's are).
"""

from __future__ import annotations

import pytest
import torch

from ninfer import LLM, SamplingParams

#: the first one the test preset continues with whitespace its MTP head drafts right three deep
PROMPTS = ["import os\nimport os\nimport os\nimport", "import os\nimport sys\n\n", "class Point:\n    def __init__(self",
           "x = [1, 2"]
SETTINGS = dict(dtype="fp32", device="cpu", max_concurrency=4, prefill_chunk=8, max_context=256)
#: plain greedy (Qwen3.5's presets add a presence penalty, which rounds on the device leave to the host)
GREEDY = dict(temperature=0, presence_penalty=0.0)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    from ninfer.cli.train import main

    out = tmp_path_factory.mktemp("trained-rounds")
    main([str(out), "--preset", "test", "--seed", "0", "-q"])
    return str(out)


def _run(llm, prompts, params):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def _engines(model, **settings):
    """Plain decoding, host-driven rounds and device rounds of the same checkpoint."""
    settings = {**SETTINGS, **settings}
    return (LLM(model, **settings), LLM(model, spec="mtp", draft_tokens=3, **settings),
            LLM(model, spec="mtp", draft_tokens=3, decode_ahead_on_cpu=True, **settings))


@pytest.mark.parametrize("reuse,block", [(False, 16), (True, 4)], ids=["no-reuse", "reuse-pages-of-4"])
def test_device_rounds_equal_plain_greedy_and_the_host_rounds_drafts(trained, reuse, block):
    plain, host, device = _engines(trained, prefix_reuse=reuse, block_size=block)
    assert host.engine.runner.rounds is None and device.engine.runner.rounds is not None
    params = SamplingParams(max_tokens=40, ignore_eos=True, **GREEDY)
    expected = _run(plain, PROMPTS, params)
    assert _run(host, PROMPTS, params) == expected
    assert _run(device, PROMPTS, params) == expected
    h, d = host.engine.stats, device.engine.stats
    # the drafts made on the device are the host's: the same rounds keep the same drafts
    assert (d.total_rounds, d.total_drafted, d.total_accepted) == (h.total_rounds, h.total_drafted, h.total_accepted)
    assert d.total_accepted > 0 and d.total_steps_ahead > 5  # the path under test really ran
    assert len(d.total_kept) == 3 and d.total_kept[2] > 0  # a third draft was kept somewhere


def test_rows_that_stop_while_a_round_runs_ahead(trained):
    """End-of-sequence, stop strings and output budgets end rows mid-round, while the round
    after it is already launched; the others go on (in a smaller bucket) unchanged."""
    plain, _, device = _engines(trained, block_size=16, prefix_reuse=False)
    cases = [SamplingParams(max_tokens=n, **GREEDY) for n in (9, 23, 40, 31)]
    for params in cases:
        assert _run(device, PROMPTS, params) == _run(plain, PROMPTS, params)
    stops = SamplingParams(max_tokens=40, stop=["\n", "):"], **GREEDY)
    got = device.generate(PROMPTS, stops)
    want = plain.generate(PROMPTS, stops)
    assert [o.outputs[0].text for o in got] == [o.outputs[0].text for o in want]
    assert [o.outputs[0].finish_reason for o in got] == [o.outputs[0].finish_reason for o in want]
    mixed = device.generate(PROMPTS, [SamplingParams(max_tokens=n, ignore_eos=True, **GREEDY) for n in (5, 40, 17, 40)])
    ref = plain.generate(PROMPTS, [SamplingParams(max_tokens=n, ignore_eos=True, **GREEDY) for n in (5, 40, 17, 40)])
    assert [o.outputs[0].token_ids for o in mixed] == [o.outputs[0].token_ids for o in ref]
    assert device.engine.block_manager.num_used_blocks == 0 or device.engine.block_manager.num_cached_blocks
    assert not device.engine.has_unfinished()


def test_prefix_reuse_across_turns_with_device_rounds(trained):
    """A later turn resumes from state snapshots taken while device rounds ran ahead."""
    plain, _, device = _engines(trained, block_size=4)
    params = SamplingParams(max_tokens=24, ignore_eos=True, **GREEDY)
    tok = plain.get_tokenizer()
    first = tok.encode(PROMPTS[0])
    for llm in (plain, device):
        out = _run(llm, [{"prompt_token_ids": first}], params)[0]
        llm._turn = first + list(out) + tok.encode("\n\ndef sub(a, b):\n")
    assert device._turn == plain._turn
    again = [{"prompt_token_ids": device._turn}]
    assert _run(device, again, params) == _run(plain, again, params)
    assert device.engine.stats.total_steps_ahead > 0


@pytest.mark.parametrize("model", ["trained", "tiny:qwen3_5"])
def test_snapshots_taken_in_device_rounds_hold_the_plain_decode_state(model, request):
    """Every state snapshot taken while rounds run ahead (they alternate scratch banks, so a
    round never overwrites the rows the previous one's snapshots copy) holds the state
    plain decoding has after the same tokens."""
    model = request.getfixturevalue("trained") if model == "trained" else model
    plain, _, device = _engines(model, block_size=4)
    assert device.engine.runner.rounds.banked
    params = SamplingParams(max_tokens=30, ignore_eos=True, **GREEDY)
    taken = {}
    for llm in (plain, device):
        snaps, pools = llm.engine.scheduler.snapshots, llm.engine.model.state_tensors()
        capture = snaps.capture

        def spy(node, row, roller=None, tokens=None, _llm=llm, _capture=capture, _pools=pools):
            taken.setdefault(id(_llm), {})[tokens] = [t[row].clone() for t in _pools]
            return _capture(node, row, roller=roller, tokens=tokens)

        snaps.capture = spy
        _run(llm, PROMPTS[:1], params)
    want, got = taken[id(plain)], taken[id(device)]
    assert len(got) > 5 and got.keys() == want.keys()
    for tokens in got:
        for a, b in zip(got[tokens], want[tokens]):
            # verify rows fold tokens in with other fp32 roundings than one-token decode (~1e-5)
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4, msg=f"the snapshot after {tokens} tokens")
    assert device.engine.stats.total_steps_ahead > 3


def test_rows_the_device_cannot_decide_take_the_host_round_beside_device_rounds(trained):
    """A sampled, a penalised and a guided request share the batch with greedy ones: steps
    holding them are host-driven rounds, the rest device rounds; greedy output is unchanged
    and the seeded sampled request draws what it draws with host-driven rounds only."""
    from ninfer.guided.spec import GuideSpec

    plain, host, device = _engines(trained, block_size=16, prefix_reuse=False)
    params = [SamplingParams(max_tokens=30, ignore_eos=True, **GREEDY),
              SamplingParams(max_tokens=30, ignore_eos=True, temperature=0.8, seed=3),
              SamplingParams(max_tokens=30, ignore_eos=True, temperature=0, presence_penalty=0.5),
              SamplingParams(max_tokens=30, ignore_eos=True, guided=GuideSpec("regex", "[a-z ]+"), **GREEDY)]
    got, want = _run(device, PROMPTS, params), _run(plain, PROMPTS, params)
    assert [got[i] for i in (0, 2, 3)] == [want[i] for i in (0, 2, 3)]
    assert got[1] == _run(host, PROMPTS, params)[1]
    alone = [SamplingParams(max_tokens=30, ignore_eos=True, **GREEDY)] * 2
    before = device.engine.stats.total_steps_ahead
    assert _run(device, PROMPTS[:2], alone) == _run(plain, PROMPTS[:2], alone)
    assert device.engine.stats.total_steps_ahead > before


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5_moe"])
def test_device_rounds_on_the_other_hybrid_families(family):
    """Random heads accept nearly nothing, but every round still settles its state and writes
    the next inputs on the device; output equals plain greedy."""
    plain, _, device = _engines(f"tiny:{family}", block_size=4, prefix_reuse=False)
    params = SamplingParams(max_tokens=20, ignore_eos=True, **GREEDY)
    assert _run(device, PROMPTS, params) == _run(plain, PROMPTS, params)
    assert device.engine.stats.total_steps_ahead > 0


def test_the_inputs_a_round_leaves_are_the_ones_the_host_would_stage(trained, monkeypatch):
    """After a device round the static inputs hold the next round, exactly as staging that
    round from the host (the committed tokens, the round's next drafts) writes them."""
    from ninfer.engine import llm_engine
    from ninfer.engine.request import EngineRequest
    from ninfer.engine.scheduler import ScheduledChunk, SchedulerOutput

    _, _, device = _engines(trained, block_size=4, prefix_reuse=False)
    engine = device.engine
    rounds = engine.runner.rounds
    v = rounds.verify
    fields = ("input_ids", "positions", "slot_mapping", "seq_lens", "num_drafts", "pages", "state_slots", "position_rows")
    left: list = []
    launch_ahead = llm_engine.LLMEngine._launch_round_ahead

    def spy(self, current):  # what round N left, before round N + 1 (launched ahead) reads it
        left.append(({f: getattr(v, f).clone() for f in fields}, current))
        return launch_ahead(self, current)

    monkeypatch.setattr(llm_engine.LLMEngine, "_launch_round_ahead", spy)
    params = SamplingParams(max_tokens=30, ignore_eos=True, **GREEDY)
    tok = device.get_tokenizer()
    for i, prompt in enumerate(PROMPTS[:3]):
        engine.add_request(EngineRequest(f"r{i}", tok.encode(prompt), params))
    checks = 0
    while engine.has_unfinished():
        left.clear()
        engine.step()  # round N committed now; round N + 1 may be in flight
        if not left or engine._in_flight is None or any(c.seq.is_finished for c in left[0][1].sched.chunks):
            continue
        carried, current = left[0]
        chunks = current.sched.chunks
        drafts = current.pending.next_drafts
        staged = SchedulerOutput([ScheduledChunk(c.seq, rounds.width, True, tuple(d)) for c, d in zip(chunks, drafts)],
                                 num_decode=len(chunks), num_verify=len(chunks))
        held = {f: getattr(v, f).clone() for f in fields}  # round N + 2's inputs: put back after
        rounds.stage(staged)
        for f in fields:  # the real rows (padding rows only have to stay inert)
            n = len(chunks) * (rounds.width if f in ("input_ids", "positions", "slot_mapping") else 1)
            assert torch.equal(carried[f][:n], getattr(v, f)[:n]), f
        for f in fields:
            getattr(v, f).copy_(held[f])
        checks += 1
    assert checks > 3


def test_a_round_that_fails_after_launching_ahead_fails_its_requests(trained, monkeypatch):
    """A round launched ahead may already have moved the device state past what the host
    has seen: if its launch fails, its requests end with an error (never continue from
    the wrong state); the engine then serves the next requests as usual."""
    from ninfer.engine.request import EngineRequest

    plain, _, device = _engines(trained, block_size=16, prefix_reuse=False)
    engine = device.engine
    params = SamplingParams(max_tokens=40, ignore_eos=True, **GREEDY)
    tok = device.get_tokenizer()
    for i, prompt in enumerate(PROMPTS[:2]):
        engine.add_request(EngineRequest(f"r{i}", tok.encode(prompt), params))
    runner, real = engine.runner, engine.runner.launch_round_ahead
    calls = []

    def failing(sched):
        calls.append(1)
        if len(calls) == 3:
            real(sched)  # the round ran on the device, then something failed
            raise RuntimeError("pinned copy failed")
        return real(sched)

    monkeypatch.setattr(runner, "launch_round_ahead", failing)
    events = []
    while engine.has_unfinished():
        events += engine.step()
    finals = {e.request_id: e for e in events if e.finished}
    assert {e.finish_reason for e in finals.values()} == {"error"} and len(calls) == 3
    monkeypatch.undo()
    assert _run(device, PROMPTS, params) == _run(plain, PROMPTS, params)
