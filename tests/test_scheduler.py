"""Continuous-batching scheduler: FIFO admission by entitlement, token-budget steps."""

from __future__ import annotations

import itertools
import random

import pytest

from ninfer.engine.block_manager import BlockManager
from ninfer.engine.scheduler import Scheduler, SchedulerOutput
from ninfer.engine.sequence import Sequence, SequenceStatus
from ninfer.engine.spec.verify_step import query_lens, verify_width
from ninfer.errors import ContextLengthExceededError

BS = 4
_ids = itertools.count()


def make_seq(prompt: int | list[int], max_tokens: int = 4) -> Sequence:
    """A sequence whose prompt is ``prompt`` itself or ``range(prompt)``."""
    tokens = list(range(prompt)) if isinstance(prompt, int) else list(prompt)
    n = next(_ids)
    return Sequence(
        seq_id=n, request_id=f"r{n}", token_ids=tokens, num_prompt_tokens=len(tokens),
        max_tokens=max_tokens,
    )


def advance(sched: Scheduler, out: SchedulerOutput, next_token: int = 1000) -> None:
    """The engine's side of a step: mark chunks computed, sample, publish, finish."""
    for chunk in out.chunks:
        seq = chunk.seq
        sched.mark_computed(chunk)
        if chunk.sample:
            sched.append_token(seq, next_token)
        sched.block_manager.commit(seq)
        if seq.num_output_tokens >= seq.max_tokens:
            sched.finish(seq, "length")


def test_admission_is_fifo_and_a_blocked_head_stops_the_queue():
    bm = BlockManager(num_blocks=6, block_size=BS)
    sched = Scheduler(bm, max_concurrency=4, prefill_chunk=8)
    first, big, small = make_seq(8, 4), make_seq(12, 4), make_seq(2, 2)  # 3, 4, 1 pages
    for seq in (first, big, small):
        sched.add(seq)
    out = sched.schedule()
    assert out.admitted == [first] and first.status is SequenceStatus.RUNNING
    # 3 pages are free; small would fit but must not overtake big.
    assert sched.num_waiting == 2 and small.status is SequenceStatus.WAITING
    assert bm.num_used_blocks == 3
    sched.finish(first, "stop")
    out = sched.schedule()
    assert out.admitted == [big, small]
    assert bm.num_used_blocks == 5


def test_max_concurrency_caps_running():
    bm = BlockManager(num_blocks=64, block_size=BS)
    sched = Scheduler(bm, max_concurrency=2, prefill_chunk=8)
    seqs = [make_seq(3) for _ in range(4)]
    for seq in seqs:
        sched.add(seq)
    sched.schedule()
    assert sched.running == seqs[:2] and sched.num_waiting == 2
    sched.finish(seqs[0], "stop")
    assert sched.schedule().admitted == [seqs[2]]
    assert sched.num_running == 2


def test_request_that_can_never_fit_is_rejected():
    sched = Scheduler(BlockManager(num_blocks=4, block_size=BS), max_concurrency=2, prefill_chunk=8)
    ok, too_big = make_seq(10, 6), make_seq(10, 7)
    assert sched.fits_ever(ok) and not sched.fits_ever(too_big)
    with pytest.raises(ContextLengthExceededError):
        sched.add(too_big)
    assert sched.num_waiting == 0


def test_token_budget_splits_prefills_in_admission_order():
    bm = BlockManager(num_blocks=64, block_size=BS)
    sched = Scheduler(bm, max_concurrency=4, prefill_chunk=4, max_batched_tokens=10)
    a, b, c, d = make_seq(9), make_seq(3), make_seq(6), make_seq(2)
    for seq in (a, b, c, d):
        sched.add(seq)
    out = sched.schedule()
    assert [(ch.seq, ch.num_tokens, ch.sample) for ch in out.chunks] == [
        (a, 4, False), (b, 3, True), (c, 3, False)
    ]  # d gets nothing: the budget is spent
    assert (out.num_batched_tokens, out.num_decode, out.num_prefill) == (10, 0, 3)
    advance(sched, out)
    # b is decode-ready now and comes first; the other three share 9 tokens.
    out = sched.schedule()
    assert [(ch.seq, ch.num_tokens, ch.sample) for ch in out.chunks] == [
        (b, 1, True), (a, 4, False), (c, 3, True), (d, 2, True)
    ]
    assert (sched.num_decode_ready, sched.num_prefilling) == (1, 3)


def test_decode_rows_are_always_scheduled_even_when_prefill_wants_everything():
    bm = BlockManager(num_blocks=64, block_size=BS)
    sched = Scheduler(bm, max_concurrency=3, prefill_chunk=100, max_batched_tokens=3)
    a, b = make_seq(1, 8), make_seq(1, 8)
    sched.add(a)
    sched.add(b)
    advance(sched, sched.schedule())  # both prefilled and sampled
    late = make_seq(50)
    sched.add(late)
    out = sched.schedule()
    assert [(ch.seq, ch.num_tokens) for ch in out.chunks] == [(a, 1), (b, 1), (late, 1)]
    assert out.num_decode == 2 and out.num_batched_tokens == 3


def test_default_budget_and_validation():
    bm = BlockManager(num_blocks=8, block_size=BS)
    assert Scheduler(bm, max_concurrency=3, prefill_chunk=16).max_batched_tokens == 19
    with pytest.raises(ValueError):
        Scheduler(bm, max_concurrency=4, prefill_chunk=16, max_batched_tokens=3)


def test_abort_waiting_and_running_frees_pages():
    bm = BlockManager(num_blocks=8, block_size=BS)
    sched = Scheduler(bm, max_concurrency=1, prefill_chunk=8)
    running, waiting = make_seq(5), make_seq(5)
    sched.add(running)
    sched.add(waiting)
    sched.schedule()
    assert bm.num_used_blocks == 3
    assert sched.abort(waiting.request_id) is waiting
    assert sched.abort(running) is running
    for seq in (running, waiting):
        assert seq.status is SequenceStatus.FINISHED and seq.finish_reason == "abort"
        assert seq.block_table == []
    assert bm.num_free_blocks == 8
    assert sched.abort(running) is None and sched.abort("nope") is None
    sched.finish(running, "stop")  # a late finish keeps the first reason
    assert running.finish_reason == "abort"
    assert sched.schedule().is_empty and not sched.has_unfinished


def test_prefix_hit_prefills_only_the_suffix():
    bm = BlockManager(num_blocks=32, block_size=BS)
    sched = Scheduler(bm, max_concurrency=2, prefill_chunk=16)
    first = make_seq(10, 1)
    sched.add(first)
    advance(sched, sched.schedule())
    assert first.is_finished
    again = make_seq(11, 2)  # shares the first 10 prompt tokens
    sched.add(again)
    out = sched.schedule()
    assert again.num_cached_tokens == 8
    assert [(ch.num_tokens, ch.sample) for ch in out.chunks] == [(3, True)]


def test_simulated_engine_runs_everything_to_completion():
    """Drive mixed-length requests with shared prefixes through a fake KV store.

    Each KV slot records the exact prefix whose last token it holds. Before a sequence
    computes a position, every earlier position must be present in its block table with
    the right prefix, so a wrong reuse, an overwritten shared page or a stale eviction
    all show up as a mismatch.
    """
    rng = random.Random(0)
    bm = BlockManager(num_blocks=20, block_size=BS)
    sched = Scheduler(bm, max_concurrency=3, prefill_chunk=5, max_batched_tokens=8)
    system = [rng.randrange(50) for _ in range(9)]
    seqs = []
    for i in range(12):
        own = [rng.randrange(50) for _ in range(rng.randrange(1, 14))]
        seq = make_seq((system if i % 2 else []) + own, max_tokens=rng.randrange(1, 9))
        seqs.append(seq)
        sched.add(seq)
    kv: dict[int, tuple[int, ...]] = {}
    computed: dict[int, list[int]] = {seq.seq_id: [] for seq in seqs}
    max_step = 0
    for _ in range(500):
        if not sched.has_unfinished:
            break
        out = sched.schedule()
        assert not out.is_empty
        assert out.num_batched_tokens <= sched.max_batched_tokens
        assert all(ch.num_tokens == 1 for ch in out.chunks[: out.num_decode])
        max_step = max(max_step, out.num_batched_tokens)
        for chunk in out.chunks:
            seq = chunk.seq
            table = seq.block_table
            for pos in range(seq.num_computed_tokens, seq.num_computed_tokens + chunk.num_tokens):
                for earlier in range(pos):
                    slot = table[earlier // BS] * BS + earlier % BS
                    assert kv[slot] == tuple(seq.token_ids[: earlier + 1])
                page = table[pos // BS]
                assert bm.refcount(page) == 1 and page not in bm.cache  # private, unpublished
                kv[page * BS + pos % BS] = tuple(seq.token_ids[: pos + 1])
                computed[seq.seq_id].append(pos)
        for chunk in out.chunks:
            seq = chunk.seq
            sched.mark_computed(chunk)
            if chunk.sample:
                sched.append_token(seq, rng.randrange(50))
            # Finish before commit, as LLMEngine does: freeing must still publish.
            if seq.num_output_tokens >= seq.max_tokens:
                sched.finish(seq, "length")
            bm.commit(seq)
        assert sched.num_running <= 3
    assert not sched.has_unfinished
    assert max_step == 8  # the budget was actually binding at some point
    assert bm.num_hit_tokens > 0 and bm.num_evicted_blocks > 0  # reuse and eviction both ran
    for seq in seqs:
        assert seq.is_finished and seq.num_output_tokens == seq.max_tokens
        # Exactly once each, from the reused prefix to the last fed-back token.
        assert computed[seq.seq_id] == list(range(seq.num_cached_tokens, seq.num_tokens - 1))
    assert bm.num_free_blocks == bm.num_blocks and bm.num_used_blocks == 0
    assert all(bm.refcount(b) == 0 for b in range(bm.num_blocks))


def test_rows_without_drafts_verify_beside_rows_with_some_and_decode_plainly_otherwise():
    """A speculating row with nothing to propose (listed with no drafts) joins a step's
    verify rows, so the step is all verify rows as a verify graph holds them; with no row
    drafting, or when not listed at all (it may not speculate), it decodes plainly. A row
    with speculative slack keeps the step's whole width up to its last token."""
    bm = BlockManager(num_blocks=64, block_size=BS)
    sched = Scheduler(bm, max_concurrency=3, prefill_chunk=100)
    a, b, c = make_seq(3, 8), make_seq(3, 8), make_seq(3, 8)
    b.spec_slack = 3  # entitled to 3 + 8 + 3 tokens: 4 pages rather than 3
    for seq in (a, b, c):
        sched.add(seq)
    advance(sched, sched.schedule())
    assert len(b.block_table) == 4 and len(a.block_table) == 3
    out = sched.schedule({a.seq_id: [7, 8], b.seq_id: []})
    assert [(ch.seq, ch.drafts) for ch in out.chunks] == [(a, (7, 8)), (b, ()), (c, ())]
    assert out.num_verify == 2 and out.num_decode == 3
    out = sched.schedule({a.seq_id: [], b.seq_id: []})
    assert out.num_verify == 0 and [ch.num_tokens for ch in out.chunks] == [1, 1, 1]
    # at the last token of the budget (10 computed): without slack a row cannot take a
    # width of 3 (positions 10-12 of its 12 tokens of pages), with it it can
    for seq in (a, b):
        seq.token_ids += [1000] * 7
        seq.num_computed_tokens = len(seq.token_ids) - 1
    out = sched.schedule({a.seq_id: [], b.seq_id: [7, 8]})
    assert [(ch.seq, ch.drafts) for ch in out.chunks[: out.num_verify]] == [(b, (7, 8))]
    out = sched.schedule({a.seq_id: [7, 8], b.seq_id: []})
    assert out.num_verify == 0  # a was dropped for its pages, and b has nothing to verify alone


def test_verify_rows_take_the_engines_whole_width_where_their_pages_hold_it():
    """A step's verify rows are padded to the engine's whole width (1 + its draft count),
    as the verify graphs pad theirs, so a step outside the graphs (here beside a prefill
    chunk) has one width whatever the drafts a request's last tokens leave; a row whose
    pages end sooner keeps the step at the most drafts + 1. The budget counts the padding."""
    bm = BlockManager(num_blocks=64, block_size=BS)
    sched = Scheduler(bm, max_concurrency=3, prefill_chunk=100, max_batched_tokens=20, draft_tokens=3)
    a, b = make_seq(3, 8), make_seq(3, 8)
    a.spec_slack = 3
    for seq in (a, b):
        sched.add(seq)
    advance(sched, sched.schedule())
    late = make_seq(40, 4)
    sched.add(late)
    out = sched.schedule({a.seq_id: [7]})  # one draft, beside b's plain row and late's prefill
    assert out.num_verify == 1 and out.num_prefill == 1
    assert out.verify_width == 4 and verify_width(out) == 4
    assert query_lens(out)[0] == 4
    # the budget took the padded width: 20 tokens less 4 verify rows and 1 plain row
    assert out.chunks[-1].num_tokens == 15
    # near its last token a row without slack has no room for the whole width
    b.token_ids += [1000] * 7
    b.num_computed_tokens = len(b.token_ids) - 1
    out = sched.schedule({b.seq_id: [7]})
    assert out.num_verify == 1 and out.verify_width == 2
