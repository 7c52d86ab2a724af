"""The host KV tier: evicted prefix pages copied to host memory, matched there, and copied
back into fresh device blocks with their content intact."""

from __future__ import annotations

import itertools

import pytest
import torch

from ninfer import LLM, SamplingParams
from ninfer.engine import host_kv
from ninfer.engine.block_manager import BlockManager
from ninfer.engine.host_kv import HostKVTier
from ninfer.engine.sequence import Sequence
from ninfer.engine.stats import ContextCacheCounters

BS = 4
_ids = itertools.count()


def _pages(num_blocks: int) -> list[torch.Tensor]:
    """Two tensors indexed by page, of different shapes and dtypes (like K/V plus scales)."""
    return [torch.zeros(num_blocks, BS, 2, 3), torch.zeros(num_blocks, BS, dtype=torch.int16)]


def _write(pages: list[torch.Tensor], block_id: int, value: int) -> None:
    for t in pages:
        t[block_id] = value


def _read(pages: list[torch.Tensor], block_id: int) -> int:
    values = {int(v) for t in pages for v in t[block_id].flatten()}
    assert len(values) == 1, "a page was copied only in part"
    return values.pop()


def test_capacity_comes_from_the_budget_and_memory_comes_lazily(monkeypatch):
    pages = _pages(4)
    page_bytes = BS * 2 * 3 * 4 + BS * 2
    tier = HostKVTier(pages, max_bytes=10 * page_bytes)
    assert tier.page_bytes == page_bytes and tier.capacity == 10
    assert tier.allocated_bytes == 0 and not tier.pin  # CPU tensors: plain host memory
    monkeypatch.setattr(host_kv, "SLAB_BYTES", 4 * page_bytes)  # slabs of 4 pages
    tier = HostKVTier(pages, max_bytes=10 * page_bytes)
    for block in range(4):
        _write(pages, block, block + 1)
        tier.store(block)
    assert tier.allocated_bytes == 4 * page_bytes
    tier.store(0)
    assert tier.allocated_bytes == 8 * page_bytes and tier.num_pages == 5


def test_store_and_restore_preserve_content_exactly():
    pages = _pages(3)
    tier = HostKVTier(pages, max_bytes=1 << 20)
    _write(pages, 1, 42)
    page, dropped = tier.store(1)
    assert dropped is None
    assert all(int(t.flatten()[0]) == 42 for t in tier.read(page))
    _write(pages, 1, -5)  # the device block is reused
    tier.restore(page, 2)
    assert _read(pages, 2) == 0  # queued until the flush
    tier.flush()
    assert _read(pages, 2) == 42 and tier.num_pages == 0


def test_a_flush_copies_runs_in_the_order_they_were_queued(monkeypatch):
    """Stores and restores queue up and are issued in order at the flush, runs of one kind
    to consecutive host rows together, whether their device blocks are consecutive or not,
    and never across a slab's end. A host page restored, then taken by a later store in
    the same flush, gives the restore its old content."""
    pages = _pages(12)
    page_bytes = BS * 2 * 3 * 4 + BS * 2
    monkeypatch.setattr(host_kv, "SLAB_BYTES", 3 * page_bytes)  # slabs of 3 pages
    tier = HostKVTier(pages, max_bytes=6 * page_bytes)
    for block in range(12):
        _write(pages, block, 100 + block)
    stored = {block: tier.store(block)[0] for block in (0, 1, 2, 3, 7, 5)}  # across two slabs
    assert sorted(stored.values()) == list(range(6))
    tier.flush()
    for block in range(12):
        _write(pages, block, -1)  # the device blocks are overwritten after the flush
    tier.restore(stored[7], 9)
    tier.restore(stored[0], 10)
    page, dropped = tier.store(4)  # the tier is full again: takes a freed page
    assert page in (stored[7], stored[0]) and dropped is None
    tier.restore(stored[5], 11)
    tier.flush()
    assert [_read(pages, b) for b in (9, 10, 11)] == [107, 100, 105]
    assert [int(t.flatten()[0]) for t in tier.read(page)] == [-1, -1]  # block 4's content then


def test_a_full_tier_drops_its_oldest_page_but_never_a_held_one():
    pages = _pages(4)
    tier = HostKVTier(pages, max_bytes=2 * pages[0][0].nbytes + 2 * pages[1][0].nbytes)
    assert tier.capacity == 2
    first, _ = tier.store(0)
    second, _ = tier.store(1)
    tier.hold(first)  # an admission matched it: it must survive until restored
    third, dropped = tier.store(2)
    assert dropped == second and third == second
    tier.hold(third)
    assert tier.store(3) == (None, None)  # no room, nothing evictable


def test_a_full_tier_drops_unretained_copies_before_retained_ones():
    pages = _pages(5)
    tier = HostKVTier(pages, max_bytes=3 * sum(t[0].nbytes for t in pages))
    kept, _ = tier.store(0, retained=True)  # the oldest, but a checkpoint retains it
    plain, _ = tier.store(1)
    later, _ = tier.store(2)
    assert tier.store(3)[1] == plain  # the oldest unretained copy goes first
    tier.set_retained(kept, False)  # its checkpoint left: an ordinary copy again (the newest)
    tier.set_retained(later, True)
    _, dropped = tier.store(4)
    assert dropped not in (kept, later) and tier.num_pages == 3


# -- the block manager ------------------------------------------------------------------


class _Frontiers:
    """Records forgotten nodes; every page is a valid frontier."""

    def __init__(self) -> None:
        self.forgotten: list[int] = []

    def has(self, node: int) -> bool:
        return True

    def forget(self, node: int) -> None:
        self.forgotten.append(node)

    def keep(self, node: int, checkpoint: bool) -> None:
        pass


def _seq(tokens: list[int], max_tokens: int = 0) -> Sequence:
    n = next(_ids)
    return Sequence(seq_id=n, request_id=f"r{n}", token_ids=list(tokens), num_prompt_tokens=len(tokens),
                    max_tokens=max_tokens)


def _run(bm: BlockManager, pages: list[torch.Tensor], tokens: list[int]) -> Sequence:
    """Admit ``tokens``, 'compute' every page (its content: the page's first token), finish."""
    seq = _seq(tokens)
    bm.allocate(seq)
    for index in range(seq.num_cached_tokens // BS, len(tokens) // BS):
        _write(pages, seq.block_table[index], tokens[index * BS])
    seq.num_computed_tokens = len(tokens)
    bm.free(seq)
    return seq


def _manager(num_blocks: int, host_pages: int) -> tuple[BlockManager, list[torch.Tensor], _Frontiers]:
    pages = _pages(num_blocks)
    tier = HostKVTier(pages, max_bytes=host_pages * sum(t[0].nbytes for t in pages))
    bm = BlockManager(num_blocks, BS, host_kv=tier, frontier_index=_Frontiers())
    return bm, pages, bm.frontier_index


def test_evicted_pages_spill_and_a_hit_brings_them_back():
    bm, pages, frontiers = _manager(num_blocks=4, host_pages=8)
    a = list(range(100, 113))  # three full pages (+1 token)
    _run(bm, pages, a)
    _run(bm, pages, list(range(200, 216)))  # four pages: every cached page of `a` is evicted
    assert bm.num_spilled_blocks == 3 and bm.cache.num_host_pages == 3 and not frontiers.forgotten
    again = _seq(a + [7])
    bm.allocate(again)
    assert again.num_cached_tokens == 12 and bm.num_restored_blocks == 3
    assert [_read(pages, b) for b in again.block_table[:3]] == [100, 104, 108]
    assert bm.cache.num_host_pages == 4  # the four blocks it took held the other sequence's pages
    bm.free(again)
    assert bm.num_used_blocks == 0


def test_a_host_hit_mixed_with_device_hits():
    bm, pages, _ = _manager(num_blocks=6, host_pages=8)
    a = list(range(100, 113))
    _run(bm, pages, a)
    _run(bm, pages, [1] * 12)  # the clean blocks suffice: nothing is evicted
    assert bm.num_spilled_blocks == 0
    _run(bm, pages, [2] * 8)  # evicts the least recently freed cached pages: a's last two
    assert bm.num_spilled_blocks == 2
    again = _seq(a + [7])
    bm.allocate(again)
    assert again.num_cached_tokens == 12 and bm.num_restored_blocks == 2
    assert [_read(pages, b) for b in again.block_table[:3]] == [100, 104, 108]
    bm.free(again)
    assert bm.num_used_blocks == 0


def test_host_eviction_forgets_the_page_and_its_frontier():
    bm, pages, frontiers = _manager(num_blocks=3, host_pages=1)
    a = list(range(100, 108))  # two full pages
    _run(bm, pages, a)
    _run(bm, pages, list(range(200, 212)))  # a's two pages leave; only one fits on the host
    assert bm.num_spilled_blocks == 2 and bm.cache.num_host_pages == 1 and len(frontiers.forgotten) == 1
    again = _seq(a + [7])
    bm.allocate(again)
    # a's tail page was spilled first and then dropped for its head page: only the head matches
    assert again.num_cached_tokens == 4 and _read(pages, again.block_table[0]) == 100


def test_without_a_host_tier_eviction_forgets():
    frontiers = _Frontiers()
    bm = BlockManager(3, BS, frontier_index=frontiers)
    pages = _pages(3)
    _run(bm, pages, list(range(100, 108)))
    _run(bm, pages, list(range(200, 212)))
    assert len(frontiers.forgotten) == 2 and bm.num_spilled_blocks == 0
    again = _seq(list(range(100, 108)) + [7])
    bm.allocate(again)
    assert again.num_cached_tokens == 0


# -- the engine --------------------------------------------------------------------------


GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
SHARED = "A shared system prompt that is long enough to fill several pages of the cache."


@pytest.mark.usefixtures("one_thread")
def test_dense_model_reuses_a_prefix_after_its_pages_left_the_device(tiny_qwen3):
    settings = dict(dtype="fp32", device="cpu", max_concurrency=1, prefill_chunk=16, block_size=4,
                    max_context=64, kv_capacity=64)
    llm = LLM(str(tiny_qwen3), **settings)
    tok = llm.get_tokenizer()
    prompt = tok.encode(SHARED)
    other = tok.encode("Something else entirely, to push the shared prompt's pages out of the pool.")
    first = llm.generate({"prompt_token_ids": prompt}, GREEDY)[0]
    llm.generate({"prompt_token_ids": other}, GREEDY)
    again = llm.generate({"prompt_token_ids": prompt}, GREEDY)[0]
    counters = ContextCacheCounters.of(llm.engine.scheduler)
    assert counters.spilled_pages > 0 and counters.restored_pages > 0 and counters.snapshot_captures == 0
    assert "state snapshots" not in counters.summary()
    assert again.num_cached_tokens == (len(prompt) - 1) // 4 * 4
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    # without the host tier the same sequence of requests finds nothing
    cold = LLM(str(tiny_qwen3), host_kv_mib=0, **settings)
    cold.generate({"prompt_token_ids": prompt}, GREEDY)
    cold.generate({"prompt_token_ids": other}, GREEDY)
    missed = cold.generate({"prompt_token_ids": prompt}, GREEDY)[0]
    assert missed.num_cached_tokens < again.num_cached_tokens
    assert missed.outputs[0].token_ids == first.outputs[0].token_ids
