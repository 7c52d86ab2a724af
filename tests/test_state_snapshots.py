"""Recurrent-state snapshots: the two-tier store, the scheduler's capture points, and exact
prefix reuse for the hybrid families through the whole engine."""

from __future__ import annotations

import attrs
import pytest
import torch

from ninfer import LLM, SamplingParams
from ninfer.engine.block_manager import BlockManager
from ninfer.engine.config import EngineConfig
from ninfer.engine.parts import prefix_reuse_on
from ninfer.engine.scheduler import Scheduler
from ninfer.engine.sequence import Sequence
from ninfer.engine.state_cache import StateSnapshots, prompt_frontiers
from ninfer.engine.state_slots import RecurrentState, StateSlots
from ninfer.engine.stats import ContextCacheCounters

WORKING = 2


def _pools(rows: int) -> list[torch.Tensor]:
    return [torch.zeros(rows, 3), torch.zeros(rows, 2, 2, dtype=torch.float64)]


def _fill(pools: list[torch.Tensor], slot: int, value: float) -> None:
    for pool in pools:
        pool[slot] = value


def _value(pools: list[torch.Tensor], slot: int) -> float:
    values = {float(v) for pool in pools for v in pool[slot].flatten()}
    assert len(values) == 1, "a row was copied only in part"
    return values.pop()


def _store(num_device: int, num_host: int) -> tuple[StateSnapshots, list[torch.Tensor]]:
    pools = _pools(WORKING + num_device)
    return StateSnapshots(pools, WORKING, num_device, num_host), pools


def test_capture_and_restore_copy_whole_rows():
    snaps, pools = _store(num_device=2, num_host=0)
    _fill(pools, 0, 7.0)
    assert snaps.capture(node=11, slot=0)
    assert not snaps.capture(node=11, slot=0)  # already there: nothing copied
    _fill(pools, 0, -1.0)  # the working slot moves on
    snaps.restore(11, slot=1)
    assert _value(pools, 1) == 7.0 and snaps.where(11) == "device"
    assert (snaps.stats.captures, snaps.stats.device_hits) == (1, 1)


def test_a_rolling_snapshot_where_a_checkpoint_ends_stays_when_the_roll_moves_on():
    snaps, pools = _store(num_device=3, num_host=0)
    _fill(pools, 0, 2.0)
    snaps.capture(2, slot=0, roller=7)
    snaps.keep(2, True)  # e.g. a marked boundary at the prompt's last full page
    _fill(pools, 0, 3.0)
    snaps.capture(3, slot=0, roller=7)
    assert snaps.where(2) == "device" and snaps.where(3) == "device"
    snaps.restore(2, slot=1)
    assert _value(pools, 1) == 2.0


def test_rolling_snapshot_replaces_its_previous_one_in_place():
    snaps, pools = _store(num_device=2, num_host=0)
    _fill(pools, 0, 1.0)
    snaps.capture(node=1, slot=0)  # a prompt snapshot: kept
    for node, value in [(2, 2.0), (3, 3.0), (4, 4.0)]:
        _fill(pools, 0, value)
        snaps.capture(node, slot=0, roller=7)
    assert not snaps.has(2) and not snaps.has(3) and snaps.has(1) and snaps.has(4)
    assert snaps.stats.drops == 0  # replaced in its own row, never evicting the prompt snapshot
    snaps.finish(7)  # the last rolling one stays as the end of the turn
    _fill(pools, 0, 5.0)
    snaps.capture(node=5, slot=0, roller=8)  # another sequence: node 4 is no longer anyone's
    snaps.capture(node=6, slot=0, roller=8)
    assert snaps.has(4) and not snaps.has(5)
    snaps.restore(4, slot=1)
    assert _value(pools, 1) == 4.0


def test_a_rolling_snapshot_someone_else_used_is_kept():
    snaps, pools = _store(num_device=3, num_host=0)
    snaps.capture(node=1, slot=0, roller=7)
    snaps.restore(1, slot=1)  # another sequence resumed from it
    snaps.capture(node=2, slot=0, roller=7)
    assert snaps.has(1) and snaps.has(2)


def test_full_device_rows_spill_least_recently_used_to_host_and_back():
    snaps, pools = _store(num_device=2, num_host=2)
    for node in (1, 2):
        _fill(pools, 0, float(node))
        snaps.capture(node, slot=0)
    snaps.restore(1, slot=1)  # node 1 is now the most recent: node 2 goes first
    _fill(pools, 0, 3.0)
    snaps.capture(3, slot=0)
    assert [snaps.where(n) for n in (1, 2, 3)] == ["device", "host", "device"]
    _fill(pools, 0, 4.0)
    snaps.capture(4, slot=0)  # node 1 spills too
    _fill(pools, 0, 5.0)
    snaps.capture(5, slot=0)  # node 3 spills; the host is full, so its oldest (node 2) is dropped
    assert [snaps.where(n) for n in (1, 2, 3, 4, 5)] == ["host", None, "host", "device", "device"]
    assert (snaps.stats.spills, snaps.stats.drops) == (3, 1)
    snaps.restore(1, slot=1)
    snaps.restore(3, slot=0)
    assert _value(pools, 1) == 1.0 and _value(pools, 0) == 3.0 and snaps.stats.host_hits == 2


def test_without_host_rows_the_least_recent_is_dropped():
    snaps, pools = _store(num_device=1, num_host=0)
    snaps.capture(1, slot=0)
    snaps.capture(2, slot=0)
    assert not snaps.has(1) and snaps.has(2) and snaps.stats.drops == 1


def test_forgotten_pages_take_their_snapshots_along():
    snaps, pools = _store(num_device=1, num_host=1)
    snaps.capture(1, slot=0, roller=3)
    snaps.capture(2, slot=1)  # node 1 spills to host
    snaps.forget(1)
    snaps.forget(2)
    snaps.forget(99)  # no snapshot: nothing happens
    assert len(snaps) == 0 and snaps.stats.drops == 2
    snaps.capture(3, slot=0, roller=3)  # the dropped rolling snapshot left no trace
    assert snaps.has(3)


def test_rows_must_fit_the_pools():
    with pytest.raises(ValueError):
        StateSnapshots(_pools(3), WORKING, 2, 0)
    with pytest.raises(ValueError):
        StateSnapshots(_pools(3), WORKING, 0, 0)


def test_prompt_frontiers():
    assert prompt_frontiers(9, 4) == (4, 8)
    assert prompt_frontiers(8, 4) == (4,)  # token 8 is the last: the page ending there is not reusable
    assert prompt_frontiers(5, 4) == (4,)
    assert prompt_frontiers(4, 4) == ()


# -- the scheduler ------------------------------------------------------------------------


def _scheduler(prefill_chunk: int = 64) -> Scheduler:
    snapshots = StateSnapshots(_pools(WORKING + 4), WORKING, 4, 0)
    bm = BlockManager(64, 4, frontier_index=snapshots)
    return Scheduler(bm, WORKING, prefill_chunk=prefill_chunk, state=RecurrentState(StateSlots(WORKING), snapshots))


def _seq(i: int, tokens: list[int], max_tokens: int = 8) -> Sequence:
    return Sequence(seq_id=i, request_id=f"r{i}", token_ids=list(tokens), num_prompt_tokens=len(tokens),
                    max_tokens=max_tokens)


def _node(bm: BlockManager, tokens: list[int], num_tokens: int) -> int:
    """Node id of the published page of ``tokens`` ending at ``num_tokens``."""
    pages = bm.cache.match(tokens, bm.cache.chain_hashes(tokens, num_tokens // bm.block_size))
    assert len(pages) * bm.block_size == num_tokens
    return pages[-1].pos.node


def _step(sched: Scheduler) -> list[int]:
    """One simulated step: every chunk computed (its slot's state becomes the number of
    computed tokens), sampling rows append token 0."""
    return _step_with(sched, sched.schedule())


def _step_with(sched: Scheduler, out) -> list[int]:
    for chunk in out.chunks:
        sched.mark_computed(chunk)
        if sched.snapshots is not None:
            _fill(sched.snapshots._pools, chunk.seq.state_slot, float(chunk.seq.num_computed_tokens))
        if chunk.sample:
            sched.append_token(chunk.seq, 0)
        sched.commit(chunk.seq)
    return [c.num_tokens for c in out.chunks]


def test_prefill_stops_at_each_prompt_frontier_and_captures_there():
    sched = _scheduler()
    seq = _seq(0, list(range(1, 19)))  # 18 tokens: frontiers 12 and 16
    sched.add(seq)
    assert [_step(sched) for _ in range(3)] == [[12], [4], [2]]
    snaps = sched.snapshots
    nodes = [_node(sched.block_manager, seq.token_ids, n) for n in (12, 16)]
    assert all(snaps.where(n) == "device" for n in nodes) and len(snaps) == 2
    while not seq.is_finished:  # generating: one rolling snapshot at each page boundary
        _step(sched)
        if seq.num_output_tokens == seq.max_tokens:
            sched.finish(seq, "length")
    assert seq.num_computed_tokens == 25
    assert len(snaps) == 3 and snaps.stats.captures == 4  # 12, 16, then rolling 20 replaced by 24
    assert snaps.where(_node(sched.block_manager, seq.token_ids, 24)) == "device"


def test_steps_that_end_on_a_snapshot_frontier_are_flagged():
    """What running a step ahead must respect: a snapshot copies the state of exactly its step."""
    sched = _scheduler()
    seq = _seq(0, list(range(1, 19)))
    sched.add(seq)
    flagged = []
    while seq.num_output_tokens < 6:
        out = sched.schedule()
        flagged.append((seq.num_computed_tokens + out.chunks[0].num_tokens, sched.captures_after(out)))
        _step_with(sched, out)
    assert [frontier for frontier, due in flagged if due] == [12, 16, 20]
    assert [frontier for frontier, _ in flagged] == [12, 16, 18, 19, 20, 21, 22, 23]
    dense = Scheduler(BlockManager(64, 4), WORKING, prefill_chunk=64)
    other = _seq(1, list(range(1, 19)))
    dense.add(other)
    assert not dense.captures_after(dense.schedule())


def _run_first_request(sched: Scheduler) -> Sequence:
    """An 18-token prompt prefilled (stopping at its snapshot points 12 and 16), then finished."""
    first = _seq(0, list(range(1, 19)))
    sched.add(first)
    for _ in range(3):
        _step(sched)
    sched.finish(first, "stop")
    return first


def test_a_hit_restores_the_snapshot_and_resumes_there():
    sched = _scheduler()
    _run_first_request(sched)
    pools = sched.snapshots._pools
    _fill(pools, 0, -1.0)
    second = _seq(1, list(range(1, 19)) + [50, 51])
    sched.add(second)
    out = sched.schedule()
    assert second.num_cached_tokens == 16 and out.chunks[0].num_tokens == 4
    assert _value(pools, second.state_slot) == 16.0  # the state exactly at the matched frontier
    assert sched.snapshots.stats.device_hits == 1


def test_a_match_ends_at_the_deepest_page_with_a_snapshot():
    sched = _scheduler()
    first = _run_first_request(sched)
    bm, snaps = sched.block_manager, sched.snapshots
    # pages up to 16 are published; forgetting the snapshot at 16 leaves the one at 12
    snaps.forget(_node(bm, first.token_ids, 16))
    second = _seq(1, list(range(1, 19)) + [50])
    sched.add(second)
    sched.schedule()
    assert second.num_cached_tokens == 12 and _value(snaps._pools, second.state_slot) == 12.0
    sched.finish(second, "abort")
    snaps.forget(_node(bm, first.token_ids, 12))
    third = _seq(2, list(range(1, 19)) + [60])
    sched.add(third)
    sched.schedule()
    assert third.num_cached_tokens == 0  # pages are cached, but no snapshot: no hit


def test_an_aborted_sequence_captures_nothing_more():
    sched = _scheduler()
    seq = _seq(0, list(range(1, 14)))  # frontiers 8 and 12
    sched.add(seq)
    out = sched.schedule()
    assert out.chunks[0].num_tokens == 8
    sched.mark_computed(out.chunks[0])  # the step ran, but the engine aborts before committing it
    sched.finish(seq, "abort")
    assert len(sched.snapshots) == 0


def test_without_snapshots_a_state_model_reuses_nothing():
    state = RecurrentState(StateSlots(WORKING))
    bm = BlockManager(64, 4, enable_prefix_reuse=prefix_reuse_on(EngineConfig(), state))
    sched = Scheduler(bm, WORKING, prefill_chunk=64, state=state)
    assert not bm.enable_prefix_reuse and sched.snapshots is None
    seq = _seq(0, list(range(1, 19)))
    sched.add(seq)
    assert _step(sched) == [18]  # no snapshot frontiers to stop at


# -- the engine ---------------------------------------------------------------------------

#: plain greedy (Qwen3.5's presets add a presence penalty, which would still be exact)
GREEDY = SamplingParams(max_tokens=9, temperature=0, presence_penalty=0.0, ignore_eos=True)
TURN1 = "Once upon a time, in a land far away, there lived a"
TURN2 = " and then the story went on"
OTHER = "An unrelated request that pushes older snapshots out of the device rows."


@pytest.fixture(scope="module", params=["qwen3_next", "qwen3_5", "qwen3_5_moe"])
def tiny_hybrid(request, tmp_path_factory):
    from ninfer.tiny.make import make_tiny

    return make_tiny(tmp_path_factory.mktemp(f"tiny-{request.param}"), request.param, seed=0)


def _llm(path, **overrides) -> LLM:
    settings = dict(dtype="fp32", device="cpu", max_concurrency=2, prefill_chunk=16, block_size=4)
    return LLM(str(path), **{**settings, **overrides})


def _two_turns(llm: LLM, between: bool = False):
    """Turn 1, optionally an unrelated request, then turn 2 = turn 1's prompt and reply plus more."""
    tok = llm.get_tokenizer()
    p1 = tok.encode(TURN1)
    first = llm.generate({"prompt_token_ids": p1}, GREEDY)[0]
    if between:
        llm.generate({"prompt_token_ids": tok.encode(OTHER)}, GREEDY)
    p2 = p1 + first.outputs[0].token_ids + tok.encode(TURN2)
    second = llm.generate({"prompt_token_ids": p2}, GREEDY)[0]
    return first, second


@pytest.fixture(scope="module")
def reference(tiny_hybrid):
    first, second = _two_turns(_llm(tiny_hybrid, no_prefix_reuse=True))
    assert second.num_cached_tokens == 0
    return first.outputs[0].token_ids, second.outputs[0].token_ids


pytestmark = pytest.mark.usefixtures("one_thread")


def _check(first, second, reference, min_cached: int) -> None:
    assert (first.outputs[0].token_ids, second.outputs[0].token_ids) == reference
    assert second.num_cached_tokens >= min_cached and second.num_cached_tokens % 4 == 0


def test_second_turn_resumes_at_the_end_of_the_first(tiny_hybrid, reference):
    llm = _llm(tiny_hybrid)
    first, second = _two_turns(llm)
    # turn 1 computed its prompt and all but its last output token: the end-of-turn
    # snapshot sits at that count rounded down to a page
    end_of_turn = (len(first.prompt_token_ids) + 8) // 4 * 4
    _check(first, second, reference, min_cached=end_of_turn)
    assert llm.engine.scheduler.snapshots.stats.device_hits == 1


def test_snapshots_go_to_the_host_tier_and_back(tiny_hybrid, reference):
    llm = _llm(tiny_hybrid, device_state_slots=1, host_state_slots=4)
    snaps = llm.engine.scheduler.snapshots
    assert snaps.num_device == 1
    first, second = _two_turns(llm, between=True)
    _check(first, second, reference, min_cached=len(first.prompt_token_ids) // 4 * 4 - 4)
    assert snaps.stats.spills > 0 and snaps.stats.host_hits == 1
    counters = ContextCacheCounters.of(llm.engine.scheduler)
    assert counters.snapshot_host_hits == 1 and counters.hit_tokens == second.num_cached_tokens
    assert "hits 0 device + 1 host" in counters.summary()


def test_no_device_snapshot_rows_means_no_reuse(tiny_hybrid, reference):
    llm = _llm(tiny_hybrid, device_state_slots=0)
    assert not llm.engine.block_manager.enable_prefix_reuse
    first, second = _two_turns(llm)
    _check(first, second, reference, min_cached=0)
    assert second.num_cached_tokens == 0


def test_kv_pages_spilled_to_host_come_back_exactly(tiny_hybrid, reference):
    # 16 pages: the unrelated request needs pages turn 1 left cached, which go to the host
    llm = _llm(tiny_hybrid, max_context=64, kv_capacity=64, max_concurrency=1)
    bm = llm.engine.block_manager
    first, second = _two_turns(llm, between=True)
    _check(first, second, reference, min_cached=len(first.prompt_token_ids) // 4 * 4 - 4)
    assert bm.num_spilled_blocks > 0 and bm.num_restored_blocks > 0
    assert bm.num_used_blocks == 0


def test_decode_ahead_never_runs_past_a_snapshot(tiny_hybrid):
    # Decode steps launched ahead (on by default on CUDA) would move the state on before a
    # page-boundary snapshot is copied. Ten output tokens end turn 1 one token past a page
    # boundary, so turn 2 resumes from a snapshot taken mid-decode.
    params = attrs.evolve(GREEDY, max_tokens=10)

    def turns(llm: LLM):
        tok = llm.get_tokenizer()
        p1 = tok.encode(TURN1)
        first = llm.generate({"prompt_token_ids": p1}, params)[0]
        second = llm.generate({"prompt_token_ids": p1 + first.outputs[0].token_ids + tok.encode(TURN2)}, params)[0]
        return first, second

    want = [o.outputs[0].token_ids for o in turns(_llm(tiny_hybrid, no_prefix_reuse=True))]
    llm = _llm(tiny_hybrid, decode_ahead_on_cpu=True)
    assert llm.engine.decode_ahead
    first, second = turns(llm)
    assert [first.outputs[0].token_ids, second.outputs[0].token_ids] == want
    assert second.num_cached_tokens == (len(first.prompt_token_ids) + 9) // 4 * 4


def test_snapshot_rows_follow_max_num_seqs(tiny_hybrid):
    # the derived default (one device snapshot row per concurrent sequence) must count the
    # offline batch, or every decode step of a wide batch would spill snapshots to the host
    llm = LLM(str(tiny_hybrid), dtype="fp32", device="cpu", max_concurrency=2, max_num_seqs=5)
    assert llm.profile.engine.max_concurrency == 5
    assert llm.engine.scheduler.snapshots.num_device == 5
