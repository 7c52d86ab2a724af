"""KV page pool: entitlement reservation, refcounted prefix reuse, publishing, eviction."""

from __future__ import annotations

import itertools
from collections.abc import Iterable

import numpy as np
import pytest

from ninfer.engine import prefix_cache
from ninfer.engine.block_manager import BlockManager
from ninfer.engine.sequence import Sequence

BS = 4
_ids = itertools.count()


def make_seq(tokens: list[int], max_tokens: int = 4, **flags: bool) -> Sequence:
    n = next(_ids)
    return Sequence(
        seq_id=n, request_id=f"r{n}", token_ids=list(tokens), num_prompt_tokens=len(tokens),
        max_tokens=max_tokens, **flags,
    )


def run_to(bm: BlockManager, seq: Sequence, num_computed: int, generated: Iterable[int] = ()) -> None:
    """Pretend the engine computed up to ``num_computed`` tokens and sampled ``generated``."""
    seq.token_ids.extend(generated)
    seq.num_computed_tokens = num_computed
    bm.commit(seq)


def assert_pool_whole(bm: BlockManager) -> None:
    assert bm.num_free_blocks == bm.num_blocks
    assert bm.num_used_blocks == 0
    assert all(bm.refcount(b) == 0 for b in range(bm.num_blocks))


def test_allocate_reserves_whole_entitlement_at_once():
    bm = BlockManager(num_blocks=10, block_size=BS)
    seq = make_seq(list(range(5)), max_tokens=6)  # 11 tokens -> 3 pages
    assert bm.blocks_needed(seq) == 3
    bm.allocate(seq)
    assert len(seq.block_table) == 3 == len(set(seq.block_table))
    assert bm.num_used_blocks == 3 and bm.num_free_blocks == 7
    assert bm.usage() == pytest.approx(0.3)
    assert seq.num_computed_tokens == seq.num_cached_tokens == 0
    with pytest.raises(RuntimeError):
        bm.allocate(seq)


def test_page_ids_as_an_array_follow_each_table_a_sequence_is_given():
    """The staging array (``Sequence.pages``) is made once per table and follows the
    block manager's allocate and free, which replace the table whole."""
    bm = BlockManager(num_blocks=10, block_size=BS)
    seq = make_seq(list(range(5)), max_tokens=6)
    assert seq.pages().tolist() == []
    bm.allocate(seq)
    pages = seq.pages()
    assert pages.dtype == np.int64 and pages.tolist() == seq.block_table and seq.pages() is pages
    bm.free(seq)
    assert seq.pages().tolist() == []
    bm.allocate(seq)
    assert seq.pages().tolist() == seq.block_table


def test_output_and_prompt_arrays_follow_the_appended_tokens():
    """``Sequence.output_array`` grows with the tokens the scheduler appends (converting
    only the new ones) and always equals the output list; the prompt's array is made once."""
    seq = make_seq([7, 8, 9], max_tokens=200)
    assert seq.output_array().tolist() == [] and seq.prompt_array().tolist() == [7, 8, 9]
    for t in range(150):  # past the first buffer, so it grows
        seq.token_ids.append(t)
        if t % 7 == 0:
            assert seq.output_array().tolist() == seq.output_token_ids
    seq.token_ids.extend([1, 2])
    assert seq.output_array().dtype == np.int64 and seq.output_array().tolist() == seq.output_token_ids
    assert seq.prompt_array() is seq.prompt_array()


def test_can_allocate_and_fits_ever_count_pages():
    bm = BlockManager(num_blocks=4, block_size=BS)
    big = make_seq(list(range(10)), max_tokens=6)  # 16 tokens = 4 pages
    too_big = make_seq(list(range(10)), max_tokens=7)  # 17 tokens = 5 pages
    assert bm.fits_ever(big) and not bm.fits_ever(too_big)
    small = make_seq([1], max_tokens=3)
    bm.allocate(small)
    assert not bm.can_allocate(big)
    bm.free(small)
    assert bm.can_allocate(big)


def test_free_returns_every_page_and_is_idempotent():
    bm = BlockManager(num_blocks=8, block_size=BS)
    a, b = make_seq([1, 2, 3]), make_seq([4, 5, 6, 7, 8])
    bm.allocate(a)
    bm.allocate(b)
    assert bm.num_used_blocks == 2 + 3
    bm.free(a)
    bm.free(a)
    assert a.block_table == [] and bm.num_used_blocks == 3
    bm.free(b)
    assert_pool_whole(bm)


def test_prefix_hit_computes_only_the_suffix_and_shares_pages():
    bm = BlockManager(num_blocks=16, block_size=BS)
    a = make_seq(list(range(10)))
    bm.allocate(a)
    run_to(bm, a, 10)  # pages 0 and 1 are full; page 2 holds 2 tokens
    b = make_seq(list(range(9)) + [99, 100])
    bm.allocate(b)
    assert b.num_cached_tokens == b.num_computed_tokens == 8  # page-granular
    assert b.block_table[:2] == a.block_table[:2]
    assert b.block_table[2] not in a.block_table
    assert bm.refcount(a.block_table[0]) == 2
    # a looked up too (and missed): 2 lookups over 10 + 11 prompt tokens, 8 hit.
    assert (bm.num_lookups, bm.num_lookup_tokens, bm.num_hit_tokens) == (2, 21, 8)
    bm.free(a)
    assert bm.refcount(b.block_table[0]) == 1  # still held by b
    bm.free(b)
    assert_pool_whole(bm)
    assert bm.num_cached_blocks == 2


def test_never_reuses_the_whole_prompt():
    bm = BlockManager(num_blocks=16, block_size=BS)
    a = make_seq(list(range(8)))
    bm.allocate(a)
    run_to(bm, a, 8)
    bm.free(a)
    same = make_seq(list(range(8)))
    bm.allocate(same)
    # Both pages are cached, but the last prompt token must be computed: one page only.
    assert same.num_cached_tokens == 4 and same.num_pending_tokens == 4
    one_more = make_seq(list(range(9)))
    bm.allocate(one_more)
    assert one_more.num_cached_tokens == 8 and one_more.num_pending_tokens == 1


def test_reused_pages_are_never_written_by_the_reuser():
    bm = BlockManager(num_blocks=16, block_size=BS)
    a = make_seq(list(range(13)))
    bm.allocate(a)
    run_to(bm, a, 13)
    for length in range(1, 14):
        b = make_seq(list(range(length)))
        bm.allocate(b)
        shared = set(a.block_table)
        first_write_page = b.num_computed_tokens // BS
        assert not shared & set(b.block_table[first_write_page:])
        bm.free(b)


def test_colliding_hash_with_other_tokens_never_matches(monkeypatch):
    monkeypatch.setattr(prefix_cache, "page_hash", lambda parent, tokens: 7)
    bm = BlockManager(num_blocks=16, block_size=BS)
    a = make_seq([1, 1, 1, 1, 2, 2, 2, 2, 5])
    bm.allocate(a)
    run_to(bm, a, 9)
    assert len(bm.cache) == 1  # page 1 collides with page 0: publishing stops there
    other = make_seq([2, 2, 2, 2, 5])
    bm.allocate(other)
    assert other.num_cached_tokens == 0  # same hash, other tokens
    same = make_seq([1, 1, 1, 1, 9])
    bm.allocate(same)
    assert same.num_cached_tokens == 4


def test_equal_tokens_after_a_different_prefix_never_match(monkeypatch):
    # A hash blind to the parent collides exactly where the parent check matters:
    # the same page content at another position.
    monkeypatch.setattr(prefix_cache, "page_hash", lambda parent, tokens: hash(tuple(tokens)))
    bm = BlockManager(num_blocks=16, block_size=BS)
    x, y = [1, 1, 1, 1], [2, 2, 2, 2]
    a = make_seq(x + x + y + [5])
    bm.allocate(a)
    run_to(bm, a, 13)
    assert len(bm.cache) == 1  # page 1 (x after x) is refused, so nothing after it
    repeat = make_seq(x + x + [5])
    bm.allocate(repeat)
    assert repeat.num_cached_tokens == 4
    assert repeat.block_table[1] != a.block_table[0]
    skip = make_seq(x + y + [5])
    bm.allocate(skip)
    assert skip.num_cached_tokens == 4  # a's y page followed x + x, not x


def test_publishing_an_existing_page_keeps_a_single_copy():
    bm = BlockManager(num_blocks=16, block_size=BS)
    a, b = make_seq(list(range(9))), make_seq(list(range(9)))
    bm.allocate(a)
    bm.allocate(b)  # admitted together: nothing to reuse yet
    assert b.num_cached_tokens == 0
    run_to(bm, a, 9)
    run_to(bm, b, 9)
    assert len(bm.cache) == 2  # b's identical pages stayed private
    c = make_seq(list(range(8)) + [42, 43])
    bm.allocate(c)
    assert c.block_table[:2] == a.block_table[:2]
    for seq in (a, b, c):
        bm.free(seq)
    assert_pool_whole(bm)
    assert bm.num_cached_blocks == 2


def test_eviction_takes_clean_pages_first_then_least_recently_freed():
    bm = BlockManager(num_blocks=6, block_size=BS)
    a = make_seq([1] * 8 + [9], max_tokens=3)  # 12 tokens -> 3 pages, 2 publishable
    c = make_seq([2] * 8 + [9], max_tokens=3)
    bm.allocate(a)
    bm.allocate(c)
    run_to(bm, a, 9)
    run_to(bm, c, 9)
    bm.free(a)  # freed first: its pages are the oldest cached ones
    bm.free(c)
    assert bm.num_cached_blocks == 4 and bm.num_free_blocks == 6
    filler = make_seq([3] * 5, max_tokens=3)  # 2 pages: exactly the 2 clean ones
    bm.allocate(filler)
    assert bm.num_cached_blocks == 4
    bm.free(filler)
    assert bm.num_evicted_blocks == 0
    evictor = make_seq([4] * 7, max_tokens=5)  # 3 pages: 2 clean + 1 evicted
    bm.allocate(evictor)
    assert bm.num_cached_blocks == 3 and bm.num_evicted_blocks == 1
    bm.free(evictor)  # its pages were never published: they go back clean
    assert bm.num_cached_blocks == 3
    # a's tail page went first (tails are freed before heads); a keeps page 0 only.
    probe_a, probe_c = make_seq([1] * 8 + [9], max_tokens=1), make_seq([2] * 8 + [9], max_tokens=1)
    bm.allocate(probe_a)
    bm.allocate(probe_c)
    assert probe_a.num_cached_tokens == 4
    assert probe_c.num_cached_tokens == 8


def test_hits_are_claimed_before_anything_is_evicted():
    bm = BlockManager(num_blocks=4, block_size=BS)
    a, c = make_seq([1] * 5, max_tokens=3), make_seq([2] * 5, max_tokens=3)
    bm.allocate(a)
    bm.allocate(c)
    run_to(bm, a, 5)
    run_to(bm, c, 5)
    hit_block = a.block_table[0]
    bm.free(a)
    bm.free(c)  # cached, oldest first: a's page 0, then c's page 0
    b = make_seq([1] * 5, max_tokens=11)  # 4 pages: the whole pool, one of them a hit
    bm.allocate(b)
    assert b.num_cached_tokens == 4 and b.block_table[0] == hit_block
    assert len(set(b.block_table)) == 4 and bm.num_free_blocks == 0


def test_can_allocate_counts_shared_pages_in_use_as_available():
    bm = BlockManager(num_blocks=5, block_size=BS)
    a = make_seq(list(range(9)), max_tokens=3)  # 3 pages
    bm.allocate(a)
    run_to(bm, a, 9)
    b = make_seq(list(range(9)), max_tokens=7)  # 4 pages, 2 of them shared with a
    assert bm.num_free_blocks == 2
    assert bm.can_allocate(b)
    bm.allocate(b)
    assert bm.num_free_blocks == 0 and b.num_cached_tokens == 8
    no_hit = make_seq(list(range(9)), max_tokens=7, lookup_prefix_cache=False)
    bm.free(b)
    assert not bm.can_allocate(no_hit)


def test_generated_pages_are_published_for_the_next_turn():
    bm = BlockManager(num_blocks=16, block_size=BS)
    turn1 = make_seq([1, 2, 3, 4, 5], max_tokens=6)
    bm.allocate(turn1)
    run_to(bm, turn1, 5, generated=[6])
    run_to(bm, turn1, 8, generated=[7, 8, 9])  # page 1 = [5, 6, 7, 8] now computed
    assert len(bm.cache) == 2
    bm.free(turn1)
    turn2 = make_seq(turn1.token_ids + [10, 11])
    bm.allocate(turn2)
    assert turn2.num_cached_tokens == 8


def test_free_publishes_pages_the_last_step_completed():
    bm = BlockManager(num_blocks=16, block_size=BS)
    seq = make_seq(list(range(9)), max_tokens=1)
    bm.allocate(seq)
    seq.num_computed_tokens = 9  # the prefill ran; the engine finishes before committing
    seq.token_ids.append(50)
    bm.free(seq)
    assert len(bm.cache) == 2 and bm.num_cached_blocks == 2
    bm.commit(seq)  # a late commit after free is a no-op
    assert len(bm.cache) == 2


@pytest.mark.parametrize(
    ("flags", "published"),
    [
        ({}, 2),
        ({"commit_generated": False}, 1),
        ({"commit_prefix_cache": False}, 0),
        ({"lookup_prefix_cache": False}, 2),
    ],
)
def test_commit_switches(flags, published):
    bm = BlockManager(num_blocks=16, block_size=BS)
    seq = make_seq([1, 2, 3, 4, 5, 6], max_tokens=6, **flags)
    bm.allocate(seq)
    run_to(bm, seq, 9, generated=[7, 8, 9, 10])
    assert len(bm.cache) == published


def test_lookup_switch_and_disabled_reuse_skip_the_cache():
    for bm, flags in ((BlockManager(16, BS), {"lookup_prefix_cache": False}),
                      (BlockManager(16, BS, enable_prefix_reuse=False), {})):
        a = make_seq(list(range(9)))
        bm.allocate(a)
        run_to(bm, a, 9)
        bm.free(a)
        b = make_seq(list(range(9)), **flags)
        bm.allocate(b)
        assert b.num_cached_tokens == b.num_computed_tokens == 0
        assert bm.num_hit_tokens == 0
    assert len(bm.cache) == 0 and bm.num_cached_blocks == 0 and bm.num_lookups == 0
