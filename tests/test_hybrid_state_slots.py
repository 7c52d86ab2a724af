"""State slots for recurrent-state models: the allocator, and the scheduler's admission and release."""

from __future__ import annotations

import pytest

from ninfer.engine.block_manager import BlockManager
from ninfer.engine.config import EngineConfig
from ninfer.engine.parts import prefix_reuse_on
from ninfer.engine.scheduler import Scheduler
from ninfer.engine.sequence import Sequence, SequenceStatus
from ninfer.engine.state_slots import RecurrentState, StateSlots


def _seq(i: int, prompt: int = 6, max_tokens: int = 4) -> Sequence:
    return Sequence(seq_id=i, request_id=f"r{i}", token_ids=list(range(prompt)), num_prompt_tokens=prompt,
                    max_tokens=max_tokens)


def test_take_and_release_round_trip():
    slots = StateSlots(2)
    a, b, c = _seq(0), _seq(1), _seq(2)
    assert slots.take(a) == 0 and slots.take(b) == 1
    assert a.state_slot == 0 and not slots.can_take()
    with pytest.raises(RuntimeError, match="no free state slot"):
        slots.take(c)
    slots.release(a)
    slots.release(a)  # a second release changes nothing
    assert a.state_slot is None and slots.num_free == 1
    assert slots.take(c) == 0  # the freed slot is reused
    with pytest.raises(RuntimeError, match="already holds"):
        slots.take(c)


def test_release_of_a_slot_owned_by_another_sequence_is_refused():
    slots = StateSlots(1)
    a, impostor = _seq(0), _seq(1)
    slots.take(a)
    impostor.state_slot = 0
    with pytest.raises(RuntimeError, match="does not own"):
        slots.release(impostor)
    assert slots.num_used == 1


def test_at_least_one_slot():
    with pytest.raises(ValueError):
        StateSlots(0)


def _scheduler(num_slots: int, max_concurrency: int = 4, num_blocks: int = 64) -> Scheduler:
    bm = BlockManager(num_blocks, 4, enable_prefix_reuse=False)
    return Scheduler(bm, max_concurrency, prefill_chunk=8, state=RecurrentState(StateSlots(num_slots)))


def test_admission_waits_for_a_free_slot_in_fifo_order():
    sched = _scheduler(num_slots=2)
    seqs = [_seq(i) for i in range(4)]
    for s in seqs:
        sched.add(s)
    out = sched.schedule()
    assert [s.seq_id for s in out.admitted] == [0, 1]
    assert {s.state_slot for s in out.admitted} == {0, 1}
    assert seqs[2].status is SequenceStatus.WAITING and seqs[2].state_slot is None
    sched.finish(seqs[1], "stop")
    assert seqs[1].state_slot is None
    out = sched.schedule()
    assert [s.seq_id for s in out.admitted] == [2] and seqs[2].state_slot == 1


def test_abort_of_running_and_waiting_sequences_returns_slots():
    sched = _scheduler(num_slots=1)
    running, waiting = _seq(0), _seq(1)
    sched.add(running)
    sched.add(waiting)
    sched.schedule()
    assert running.state_slot == 0 and waiting.state_slot is None
    sched.abort("r1")  # never held one
    sched.abort(running)
    assert sched.state_slots.num_free == 1 and sched.block_manager.num_used_blocks == 0


def test_prefix_reuse_needs_snapshots_for_a_state_model():
    # cached pages alone cannot resume a model with recurrent state
    with pytest.raises(ValueError, match="snapshots"):
        Scheduler(BlockManager(64, 4, enable_prefix_reuse=True), 2, prefill_chunk=8,
                  state=RecurrentState(StateSlots(2)))


def test_without_snapshots_prefix_reuse_is_off():
    config = EngineConfig(max_concurrency=2, prefix_reuse=True)
    state = RecurrentState(StateSlots(2))
    assert not prefix_reuse_on(config, state)
    assert prefix_reuse_on(config, None)  # a model without state reuses pages alone
    bm = BlockManager(64, 4, enable_prefix_reuse=prefix_reuse_on(config, state))
    sched = Scheduler(bm, 2, prefill_chunk=8, state=state)
    # a repeated prompt finds nothing cached
    first = _seq(0, prompt=12)
    sched.add(first)
    out = sched.schedule()
    sched.mark_computed(out.chunks[0])
    sched.finish(first, "stop")
    again = _seq(1, prompt=12)
    sched.add(again)
    sched.schedule()
    assert again.num_cached_tokens == 0 and again.num_computed_tokens == 0
