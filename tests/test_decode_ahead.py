"""Decode steps launched ahead (before the host has the previous tokens) change nothing.

On CUDA the engine queues a decode step behind the current one; here the same code path
runs on CPU (``LLM(..., decode_ahead_on_cpu=True)``), where it is merely synchronous, and
every output must equal the one-step-at-a-time engine's.
"""

from __future__ import annotations

import attrs
import pytest

from ninfer import LLM, SamplingParams
from ninfer.engine.block_manager import BlockManager
from ninfer.engine.decode_ahead import plan_ahead
from ninfer.engine.request import EngineRequest
from ninfer.engine.scheduler import ScheduledChunk, Scheduler, SchedulerOutput
from ninfer.engine.sequence import Sequence
from ninfer.guided.spec import GuideSpec

PROMPTS = ["Hello", "The quick brown fox", "def f(x):\n    return", "1 2 3 4 5", "Paged", "a b"]


def _llm(ahead: bool, family: str = "qwen3", **kw) -> LLM:
    return LLM(f"tiny:{family}", device="cpu", dtype="fp32", max_concurrency=4, prefill_chunk=16,
               max_context=128, kv_capacity=2048, decode_ahead_on_cpu=ahead, **kw)


def _mixed_params() -> list[SamplingParams]:
    return [
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=1.0, top_k=5, seed=3, max_tokens=9, logprobs=3, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=30),  # may stop at EOS
        SamplingParams(temperature=0.7, seed=11, max_tokens=15, stop=["e"]),
        SamplingParams(temperature=0, max_tokens=1, ignore_eos=True),
    ]


def _outputs(llm: LLM, params) -> list[tuple]:
    outs = llm.generate(PROMPTS, params)
    return [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason,
             [attrs.asdict(p) for p in (o.outputs[0].logprobs or [])]) for o in outs]


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe", "qwen3_5_moe"])
def test_outputs_equal_with_and_without_steps_launched_ahead(family):
    """Every family, the hybrid's recurrent state and its per-page snapshots included."""
    sync = _outputs(_llm(False, family), _mixed_params())
    ahead_llm = _llm(True, family)
    ahead = _outputs(ahead_llm, _mixed_params())
    assert ahead_llm.engine.stats.total_steps_ahead > 10  # the path under test really ran
    assert ahead == sync
    assert not ahead_llm.engine.has_unfinished()
    assert ahead_llm.engine.block_manager.num_used_blocks == 0  # every page came back


def test_penalised_rows_run_ahead_and_count_the_token_in_flight():
    """Penalties count the newest output token on the device when the host does not have
    it yet, so penalised rows run ahead and give the one-step-at-a-time tokens: greedy with
    strong penalties (every repeat is steered away from) and seeded sampling."""
    params = [
        SamplingParams(temperature=0, max_tokens=24, presence_penalty=2.0, frequency_penalty=0.5, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=24, repetition_penalty=1.8, ignore_eos=True),
        SamplingParams(temperature=0.9, seed=5, max_tokens=24, presence_penalty=1.5, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),  # beside a row without penalties
    ]
    sync = _llm(False).generate(PROMPTS[:4], params)
    llm = _llm(True)
    got = llm.generate(PROMPTS[:4], params)
    assert llm.engine.stats.total_steps_ahead > 10
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in sync]
    # the penalties mattered: without them the greedy rows say something else
    plain = _llm(False).generate(PROMPTS[:2], [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)] * 2)
    assert [o.outputs[0].token_ids for o in plain] != [o.outputs[0].token_ids for o in sync[:2]]


def test_rows_needing_host_tokens_keep_steps_one_at_a_time():
    llm = _llm(True)
    # a guided row's mask follows its committed tokens, so the host must see each one first
    guide = GuideSpec("regex", r"[a-z]+( [a-z]+){2,5}\.")
    params = [SamplingParams(temperature=0, max_tokens=10, guided=guide)] * 2
    sync = _llm(False).generate(PROMPTS[:2], params)
    got = llm.generate(PROMPTS[:2], params)
    assert llm.engine.stats.total_steps_ahead == 0
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in sync]


def test_abort_while_a_step_runs_ahead_frees_everything():
    llm = _llm(True)
    engine = llm.engine
    ids = llm.get_tokenizer().encode("Hello there")
    for rid in ("a", "b"):
        engine.add_request(EngineRequest(rid, ids, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)))
    for _ in range(6):
        engine.step()
    assert engine._in_flight is not None  # a decode step is queued ahead
    engine.abort_request("a")
    produced = []
    while engine.has_unfinished():
        produced += [e for e in engine.step() if e.request_id == "b"]
    assert produced[-1].finished and produced[-1].num_output_tokens == 40
    assert engine.block_manager.num_used_blocks == 0
    # the engine takes new work normally afterwards
    engine.add_request(EngineRequest("c", ids, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)))
    while engine.has_unfinished():
        last = engine.step()
    assert last[-1].finished and last[-1].num_output_tokens == 3


def _decode_ready(seq_id: int, max_tokens: int = 10) -> Sequence:
    """Two prompt tokens and one output token (the output still to be computed)."""
    return Sequence(seq_id, f"r{seq_id}", [5, 6, 7], num_prompt_tokens=2, max_tokens=max_tokens)


def _decoding(seqs: list[Sequence], waiting: tuple[Sequence, ...] = ()) -> tuple[SchedulerOutput, Scheduler]:
    """The decode step of ``seqs``, admitted by a scheduler of two slots with their prompts
    computed, and that scheduler (``waiting`` queued behind them)."""
    scheduler = Scheduler(BlockManager(64, 4), max_concurrency=2, prefill_chunk=8)
    for seq in seqs:
        scheduler.add(seq)
    scheduler.schedule()
    for seq in seqs:
        scheduler.mark_computed(ScheduledChunk(seq, 2, sample=False))
    for seq in waiting:
        scheduler.add(seq)
    return SchedulerOutput(chunks=[ScheduledChunk(s, 1, sample=True) for s in seqs], num_decode=len(seqs)), scheduler


def test_plan_ahead_rules():
    never = lambda seq: False  # noqa: E731
    a, b = _decode_ready(0), _decode_ready(1)
    plan, rows = plan_ahead(*_decoding([a, b]), never, 128)
    assert [c.seq for c in plan.chunks] == [a, b] and rows == [0, 1]
    # a request waits and there is room to admit it: the next batch will differ
    assert plan_ahead(*_decoding([_decode_ready(0)], waiting=(_decode_ready(2),)), never, 128) == (None, [])
    # ...but with the batch full it cannot be admitted anyway
    full = _decoding([_decode_ready(0), _decode_ready(1)], waiting=(_decode_ready(2),))
    assert plan_ahead(*full, never, 128)[1] == [0, 1]
    # a row whose current token is its last (max_tokens 2: this is output token 2) stays out
    a, last = _decode_ready(0), _decode_ready(3, max_tokens=2)
    plan, rows = plan_ahead(*_decoding([a, last]), never, 128)
    assert [c.seq for c in plan.chunks] == [a] and rows == [0]
    # so does a row reaching the context limit
    assert plan_ahead(*_decoding([_decode_ready(0), _decode_ready(1)]), never, 4)[0] is None
    # one row needing its token on the host keeps the whole step synchronous
    a, b = _decode_ready(0), _decode_ready(1)
    assert plan_ahead(*_decoding([a, b]), lambda s: s is b, 128) == (None, [])
    # a prefill chunk in the step: no
    a, b = _decode_ready(0), _decode_ready(1)
    _, scheduler = _decoding([a, b])
    prefill = SchedulerOutput(chunks=[ScheduledChunk(a, 1, True), ScheduledChunk(b, 2, True)], num_decode=1,
                              num_prefill=1)
    assert plan_ahead(prefill, scheduler, never, 128) == (None, [])


def test_decode_ahead_can_be_switched_off_from_the_command_line():
    from ninfer.cli.serve import build_parser
    from ninfer.profile.flags import overrides_from_args

    assert overrides_from_args(build_parser().parse_args(["--no-decode-ahead"])) == {"engine.decode_ahead": False}
    assert _llm(False, decode_ahead=False).profile.engine.decode_ahead is False
    default = _llm(False)
    assert default.profile.engine.decode_ahead is True  # on by default...
    assert not default.engine.decode_ahead  # ...but it acts on CUDA only
    assert not _llm(True, decode_ahead=False).engine.decode_ahead  # off in the profile: off everywhere


def test_decode_ahead_is_switched_only_while_idle():
    """ninfer-bench measures one loaded engine both ways; a running request keeps its mode."""
    engine = _llm(True).engine
    engine.add_request(EngineRequest("a", [1, 2, 3], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)))
    with pytest.raises(RuntimeError, match="no request runs"):
        engine.set_decode_ahead(False)
    while engine.has_unfinished():
        engine.step()
    engine.set_decode_ahead(False)
    assert not engine.decode_ahead
