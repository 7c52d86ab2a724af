"""The paged KV pool: page reservation per sequence, refcounted sharing, prefix reuse.

A sequence is admitted only with its whole prompt-plus-output entitlement in pages
(:attr:`Sequence.entitlement_tokens`, speculative slack included), so a running request
can never run out of KV space and nothing is ever preempted. Shared
pages are always full and immutable: a sequence reuses only whole pages strictly before
its last prompt token, and it writes only at positions at or past ``num_computed_tokens``,
which therefore always fall into pages of its own.

Free pages live in two pools: clean ones (no reusable content) and cached ones that
still hold published content. Allocation drains the clean pool first and then reclaims
a cached page in the order of :mod:`ninfer.engine.reclaim`: pages no checkpoint
(:mod:`ninfer.engine.context_cache`) retains first, least recently freed first, then
retained chains from their tail, cheapest to recompute first. With a host tier
(:mod:`ninfer.engine.host_kv`) a reclaimed page is copied there when copying it out and
back costs less than recomputing it (:mod:`ninfer.engine.context_cost`), and stays
matchable; a hit on it gets a fresh block and the copy back.

The checkpoints themselves are kept here too: the block manager knows each sequence's
chain of published pages, so it tells its :class:`ContextCache` what a request's hit
landed on (``seq.reuse_path``), which marked boundaries its pages reached, and what it
left behind when it finished.

Models with recurrent state can resume only where a state snapshot exists, so their
block manager is built with a :class:`FrontierIndex`: a match then ends at its deepest
page that has one, and the index hears about every page the cache forgets.

The scheduler composes the block manager and is its only caller; the sequence fields
it writes (``block_table``, ``num_cached_tokens`` and, at admission, the reused prefix's
``num_computed_tokens``) are written nowhere else.
"""

from __future__ import annotations

from collections import deque
from typing import Optional, Protocol

from ninfer.engine.context_cache import ContextCache, DescriptorLimits
from ninfer.engine.context_cost import DEFAULT_COSTS, ContextCosts
from ninfer.engine.host_kv import HostKVTier
from ninfer.engine.prefix_cache import CachedPage, ChainPos, PrefixCache
from ninfer.engine.reclaim import ReclaimOrder
from ninfer.engine.sequence import Sequence


class FrontierIndex(Protocol):
    """Which published pages (by node id) a sequence may resume right after."""

    def has(self, node: int) -> bool: ...

    def forget(self, node: int) -> None:
        """The page ``node`` is gone from the cache and can never match again."""

    def keep(self, node: int, checkpoint: bool) -> None:
        """Whether a checkpoint now ends at ``node`` (its snapshot is then kept longer)."""


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_reuse: bool = True,
        host_kv: Optional[HostKVTier] = None,
        frontier_index: Optional[FrontierIndex] = None,
        limits: Optional[DescriptorLimits] = None,
        costs: ContextCosts = DEFAULT_COSTS,
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks, block_size >= 1; got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_reuse = enable_prefix_reuse
        self.cache = PrefixCache(block_size)
        self._refcount = [0] * num_blocks
        self._clean: deque[int] = deque(range(num_blocks))
        self.costs = costs
        self._reclaim = ReclaimOrder(self._page_cost, self._is_leaf)
        #: the checkpoints (None without prefix reuse)
        self.context: Optional[ContextCache] = None
        if enable_prefix_reuse:
            self.context = ContextCache(limits or DescriptorLimits(), block_size, on_retained=self._retention_changed,
                                        on_checkpoint=self._checkpoint_changed)
        # Per running sequence: how many leading pages are in the chain, and where the
        # chain ends (None once a hash collision stopped publishing for it).
        self._chain_pages: dict[int, int] = {}
        self._chain_end: dict[int, Optional[ChainPos]] = {}
        self._chain_nodes: dict[int, list[int]] = {}  # ...and their node ids
        #: marked boundaries (page-rounded) not reached yet, each with whether it is an automatic candidate
        self._pending_shared: dict[int, list[tuple[int, bool]]] = {}
        # Prompt page hashes of waiting sequences, so a head that has to wait does not
        # rehash its prompt at every step.
        self._hash_memo: dict[int, list[int]] = {}
        # Cumulative prefix statistics, in prompt tokens, over sequences that looked up.
        self.num_lookups = 0
        self.num_lookup_tokens = 0
        self.num_hit_tokens = 0
        self.num_evicted_blocks = 0  # cached pages overwritten to serve an allocation
        self.num_spilled_blocks = 0  # ...of which a copy went to the host tier
        self.num_restored_blocks = 0  # host copies brought back for a hit
        #: where evicted cached pages go (None: they are forgotten)
        self.host_kv = host_kv
        #: which matched pages a sequence may resume after (None: any)
        self.frontier_index = frontier_index

    # -- accounting ---------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return len(self._clean) + len(self._reclaim)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Free pages that still hold reusable content."""
        return len(self._reclaim)

    @property
    def num_retained_blocks(self) -> int:
        """Free cached pages that a checkpoint retains."""
        return self._reclaim.num_retained

    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def refcount(self, block_id: int) -> int:
        return self._refcount[block_id]

    def blocks_needed(self, seq: Sequence) -> int:
        tokens = max(seq.entitlement_tokens, seq.num_tokens)
        return -(-tokens // self.block_size)

    def fits_ever(self, seq: Sequence) -> bool:
        """False when the entitlement exceeds the whole pool, so waiting cannot help."""
        return self.blocks_needed(seq) <= self.num_blocks

    # -- admission ----------------------------------------------------------------

    def _reusable_pages(self, seq: Sequence) -> int:
        """Whole pages before the last known token: at least that token gets computed."""
        if not (self.enable_prefix_reuse and seq.lookup_prefix_cache):
            return 0
        return max(seq.num_tokens - 1, 0) // self.block_size

    def _match(self, seq: Sequence) -> list[CachedPage]:
        num_pages = self._reusable_pages(seq)
        if num_pages == 0:
            return []
        root = self.cache.root(seq.lora_name)
        hashes = self._hash_memo.get(seq.seq_id)
        if hashes is None:
            hashes = self.cache.chain_hashes(seq.token_ids, num_pages, root)
            self._hash_memo[seq.seq_id] = hashes
        hits = self.cache.match(seq.token_ids, hashes, root)
        if self.frontier_index is not None:
            has = self.frontier_index.has
            while hits and not has(hits[-1].pos.node):
                hits.pop()
        return hits

    def can_allocate(self, seq: Sequence) -> bool:
        needed = self.blocks_needed(seq)
        if needed <= self.num_free_blocks:
            return True  # reuse only ever lowers the demand
        # A host-resident hit needs a fresh block like a miss; only blocks in use save one.
        shared_in_use = sum(
            1 for page in self._match(seq) if page.block_id is not None and self._refcount[page.block_id] > 0
        )
        return needed - shared_in_use <= self.num_free_blocks

    def allocate(self, seq: Sequence) -> None:
        """Reserve the whole entitlement and position the sequence after its reused prefix."""
        if seq.block_table:
            raise RuntimeError(f"sequence {seq.seq_id} already holds pages")
        if not self.can_allocate(seq):
            raise RuntimeError(f"not enough free KV pages for sequence {seq.seq_id}")
        looked_up = self._reusable_pages(seq) > 0
        hits = self._match(seq)
        seq.reuse_path = "root"
        if self.context is not None and looked_up:
            seq.reuse_path = self.context.admit(seq.seq_id, [p.pos.node for p in hits], seq.cache_hints.replay)
        self._hash_memo.pop(seq.seq_id, None)
        # Claim the hits before taking fresh pages so eviction cannot reclaim them.
        table = [self._claim(page.block_id) if page.block_id is not None else -1 for page in hits]
        for page in hits:
            if page.block_id is None:
                self.host_kv.hold(page.host_page)
        for index, page in enumerate(hits):
            if page.block_id is None:
                table[index] = self._restore(page.host_page)
        table += [self._take_fresh() for _ in range(self.blocks_needed(seq) - len(hits))]
        if self.host_kv is not None:  # the spills and restores above, in runs (host_kv.py)
            self.host_kv.flush()
        seq.block_table = table
        reused = len(hits) * self.block_size
        seq.num_cached_tokens = reused
        seq.num_computed_tokens = reused
        self._chain_pages[seq.seq_id] = len(hits)
        self._chain_end[seq.seq_id] = hits[-1].pos if hits else self.cache.root(seq.lora_name)
        self._chain_nodes[seq.seq_id] = [page.pos.node for page in hits]
        bs = self.block_size
        hints = seq.cache_hints
        explicit = {p // bs * bs for p in hints.shared if p >= bs}
        implicit = {p // bs * bs for p in hints.implicit_shared if p >= bs} - explicit
        marks = sorted([(p, False) for p in explicit] + [(p, True) for p in implicit])
        if marks and self.context is not None and seq.commit_prefix_cache:
            self._pending_shared[seq.seq_id] = marks
            self._share_reached(seq.seq_id)
        if looked_up:
            self.num_lookups += 1
            self.num_lookup_tokens += seq.num_prompt_tokens
            self.num_hit_tokens += reused

    def _claim(self, block_id: int) -> int:
        if self._refcount[block_id] == 0:
            self._reclaim.remove(block_id)
        self._refcount[block_id] += 1
        return block_id

    def _take_fresh(self) -> int:
        if self._clean:
            block_id = self._clean.popleft()
        else:
            block_id = self._reclaim.pop()
            self._evict(block_id)
        self._refcount[block_id] = 1
        return block_id

    def _evict(self, block_id: int) -> None:
        """The cached page in ``block_id`` is about to be overwritten: spill it when that
        costs less than recomputing it later, else forget it."""
        self.num_evicted_blocks += 1
        page = self.cache.page_in(block_id)
        if self.host_kv is not None and self.costs.spill_pays(page.index * self.block_size, self.block_size,
                                                              self.host_kv.page_bytes):
            retained = self.context is not None and self.context.retained(page.pos.node)
            host_page, dropped = self.host_kv.store(block_id, retained)
            if dropped is not None:
                self._forget(self.cache.evict_host(dropped))
            if host_page is not None:
                self.cache.to_host(block_id, host_page)
                self.num_spilled_blocks += 1
                self._parent_left(page)
                return
        self._forget(self.cache.evict(block_id))
        self._parent_left(page)

    def _parent_left(self, page: CachedPage) -> None:
        """``page`` left the device: its parent may now be a leaf worth reclaiming."""
        parent = self.cache.page_of(page.parent_node)
        if parent is not None and parent.block_id is not None and self.cache.device_children(parent.pos.node) == 0:
            self._reclaim.candidate(parent.block_id)

    def _page_cost(self, block_id: int) -> float:
        page = self.cache.page_in(block_id)
        return self.costs.recompute_ns(page.index * self.block_size, self.block_size)

    def _is_leaf(self, block_id: int) -> bool:
        return self.cache.device_children(self.cache.page_in(block_id).pos.node) == 0

    def _retention_changed(self, node: int, retained: bool) -> None:
        page = self.cache.page_of(node)
        if page is not None and page.block_id is not None:
            self._reclaim.set_retained(page.block_id, retained)
        elif page is not None and page.host_page is not None and self.host_kv is not None:
            self.host_kv.set_retained(page.host_page, retained)

    def _checkpoint_changed(self, node: int, present: bool) -> None:
        if self.frontier_index is not None:
            self.frontier_index.keep(node, present)

    def _share_reached(self, seq_id: int) -> None:
        """Register the marked boundaries ``seq_id``'s published chain has reached."""
        pending = self._pending_shared.get(seq_id)
        chain = self._chain_nodes.get(seq_id, [])
        while pending and pending[0][0] <= len(chain) * self.block_size:
            position, implicit = pending.pop(0)
            self.context.share(tuple(chain[: position // self.block_size]), implicit)

    def _restore(self, host_page: int) -> int:
        """A fresh block holding the host copy ``host_page`` again (published, refcount 1)."""
        block_id = self._take_fresh()
        self.host_kv.restore(host_page, block_id)
        self.cache.to_device(host_page, block_id)
        self.num_restored_blocks += 1
        return block_id

    def _forget(self, node: int) -> None:
        if self.frontier_index is not None:
            self.frontier_index.forget(node)
        if self.context is not None:
            self.context.forget(node)

    def published_node(self, seq: Sequence, num_tokens: int) -> Optional[int]:
        """The node id of ``seq``'s published page ending exactly at ``num_tokens``, if its
        chain has reached that far (and no further); None otherwise."""
        end = self._chain_end.get(seq.seq_id)
        if end is None or num_tokens <= 0 or self._chain_pages[seq.seq_id] * self.block_size != num_tokens:
            return None
        return end.node

    # -- progress and release -----------------------------------------------------

    def commit(self, seq: Sequence) -> None:
        """Publish every page of ``seq`` that is now full and wholly computed."""
        if not (self.enable_prefix_reuse and seq.commit_prefix_cache):
            return
        end = self._chain_end.get(seq.seq_id)
        if end is None:
            return  # not allocated, or its chain was cut by a collision
        limit = seq.num_computed_tokens
        if not seq.commit_generated:
            limit = min(limit, seq.num_prompt_tokens)
        full_pages = limit // self.block_size
        index = self._chain_pages[seq.seq_id]
        nodes = self._chain_nodes[seq.seq_id]
        while index < full_pages and end is not None:
            start = index * self.block_size
            tokens = tuple(seq.token_ids[start : start + self.block_size])
            end = self.cache.publish(end, tokens, seq.block_table[index], index)
            if end is not None:
                nodes.append(end.node)
            index += 1
        self._chain_pages[seq.seq_id] = index
        self._chain_end[seq.seq_id] = end
        if seq.seq_id in self._pending_shared:
            self._share_reached(seq.seq_id)

    def free(self, seq: Sequence) -> None:
        """Return every page of ``seq``; safe to call more than once.

        Pages the last step completed are published first, so reuse does not depend on
        whether the engine commits before or after it finishes a sequence.
        """
        self.commit(seq)
        nodes = self._chain_nodes.pop(seq.seq_id, None)
        if nodes is not None:
            # a page another request published first is in this chain but not held by it, and
            # may have left the cache meanwhile: the chain ends before the first such page
            present = next((i for i, node in enumerate(nodes) if self.cache.page_of(node) is None), len(nodes))
            nodes = nodes[:present]
        if self.context is not None and nodes is not None:  # what it leaves for its conversation's next turn
            self.context.finish(seq.seq_id, nodes if seq.commit_prefix_cache else [], seq.cache_hints.turn_closure)
        # Tail pages first, so under eviction a shared prefix outlives its continuations.
        for block_id in reversed(seq.block_table):
            self._refcount[block_id] -= 1
            if self._refcount[block_id] == 0:
                if block_id in self.cache:
                    node = self.cache.page_in(block_id).pos.node
                    self._reclaim.add(block_id, self.context is not None and self.context.retained(node))
                else:
                    self._clean.append(block_id)
        seq.block_table = []
        self._chain_pages.pop(seq.seq_id, None)
        self._chain_end.pop(seq.seq_id, None)
        self._hash_memo.pop(seq.seq_id, None)
        self._pending_shared.pop(seq.seq_id, None)
