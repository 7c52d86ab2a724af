"""Index of published KV pages, keyed by a hash chain over page token ids.

A page's KV depends on every token before it, so a page is identified by its own
tokens *and* its whole prefix: hash ``i`` mixes hash ``i - 1`` with page ``i``'s tokens.
The hash is a stable content digest (the same across processes, so it can also name
host-tier copies later), but a lookup never trusts it alone: the stored tokens must
equal the query's and the stored parent must be the exact page matched one step
earlier. Parents are compared by a node id that is never reused, so a page whose
parent was evicted (and whose block now holds something else) can no longer match.

KV computed under a LoRA adapter differs from the base model's for the same tokens, so
each adapter's chains start from a root of their own (:meth:`PrefixCache.root`).

A published page lives either in a device block or, once the block manager has spilled
it there (:mod:`ninfer.engine.host_kv`), in a host page. Moving keeps its node id, so
whatever is keyed on the node (recurrent-state snapshots) stays valid.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import NamedTuple, Optional


class ChainPos(NamedTuple):
    """Where a chain of pages ends: the last page's hash and node id."""

    hash: int
    node: int


#: The empty prefix every chain starts from (node ids of real pages start at 1).
ROOT = ChainPos(hash=0, node=0)


def page_hash(parent: int, tokens: Sequence[int]) -> int:
    """64-bit digest of a page given its parent's hash."""
    digest = hashlib.blake2b(parent.to_bytes(8, "little"), digest_size=8)
    digest.update(array("q", tokens).tobytes())
    return int.from_bytes(digest.digest(), "little")


@dataclass(frozen=True)
class CachedPage:
    block_id: Optional[int]  # device block holding it; None while it lives on the host
    tokens: tuple[int, ...]
    parent_node: int
    pos: ChainPos  # this page's own hash and node id
    host_page: Optional[int] = None  # host page holding it (when block_id is None)
    index: int = 0  # its place in the chain: it holds tokens [index * block_size, (index + 1) * block_size)


class PrefixCache:
    """Published pages by chain hash. Holds no refcounts: the block manager owns those."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._by_hash: dict[int, CachedPage] = {}
        self._by_block: dict[int, CachedPage] = {}
        self._by_host: dict[int, CachedPage] = {}
        self._by_node: dict[int, CachedPage] = {}
        # node -> how many of its published children sit in device blocks (a page with
        # none is a leaf there: reclaiming it strands no other device page)
        self._device_children: dict[int, int] = {}
        self._next_node = ROOT.node + 1
        self._roots: dict[str, ChainPos] = {}

    def __len__(self) -> int:
        """Published pages in device blocks (host-resident ones are not counted)."""
        return len(self._by_block)

    def __contains__(self, block_id: int) -> bool:
        return block_id in self._by_block

    @property
    def num_host_pages(self) -> int:
        return len(self._by_host)

    def page_of(self, node: int) -> Optional[CachedPage]:
        """The published page with node id ``node`` (None once forgotten)."""
        return self._by_node.get(node)

    def page_in(self, block_id: int) -> CachedPage:
        return self._by_block[block_id]

    def device_children(self, node: int) -> int:
        return self._device_children.get(node, 0)

    def _children_moved(self, page: CachedPage, delta: int) -> None:
        count = self._device_children.get(page.parent_node, 0) + delta
        if count:
            self._device_children[page.parent_node] = count
        else:
            self._device_children.pop(page.parent_node, None)

    def _page_tokens(self, token_ids: Sequence[int], index: int) -> tuple[int, ...]:
        start = index * self.block_size
        return tuple(token_ids[start : start + self.block_size])

    def root(self, namespace: Optional[str] = None) -> ChainPos:
        """Where chains of KV computed under ``namespace`` (a LoRA adapter) start; None: ROOT.

        Its hash is a digest of the name (stable across processes) and its node id a
        negative number, so it can never equal a page's or another namespace's root.
        """
        if namespace is None:
            return ROOT
        pos = self._roots.get(namespace)
        if pos is None:
            digest = hashlib.blake2b(namespace.encode(), digest_size=8, person=b"ninfer-kv-ns")
            pos = ChainPos(int.from_bytes(digest.digest(), "little"), -(len(self._roots) + 1))
            self._roots[namespace] = pos
        return pos

    def chain_hashes(self, token_ids: Sequence[int], num_pages: int, root: ChainPos = ROOT) -> list[int]:
        """Hashes of the first ``num_pages`` full pages of ``token_ids``, from ``root``."""
        hashes: list[int] = []
        parent = root.hash
        for index in range(num_pages):
            parent = page_hash(parent, self._page_tokens(token_ids, index))
            hashes.append(parent)
        return hashes

    def match(self, token_ids: Sequence[int], hashes: Sequence[int], root: ChainPos = ROOT) -> list[CachedPage]:
        """The longest run of published pages equal to the leading pages of ``token_ids``.

        ``hashes`` are ``chain_hashes(token_ids, n, root)``; at most ``n`` pages match.
        """
        pages: list[CachedPage] = []
        node = root.node
        for index, digest in enumerate(hashes):
            page = self._by_hash.get(digest)
            if (
                page is None
                or page.parent_node != node
                or page.tokens != self._page_tokens(token_ids, index)
            ):
                break
            pages.append(page)
            node = page.pos.node
        return pages

    def publish(
        self, parent: ChainPos, tokens: tuple[int, ...], block_id: int, index: int = 0
    ) -> Optional[ChainPos]:
        """Offer ``block_id`` (holding ``tokens`` after the chain ``parent``) for reuse.

        Returns the chain position to continue from. When an identical page is already
        published the existing one stands and ``block_id`` stays private. ``None`` means
        the hash is taken by different content (a collision): the caller must stop
        publishing this chain, since later pages could not be found through it anyway.
        """
        digest = page_hash(parent.hash, tokens)
        existing = self._by_hash.get(digest)
        if existing is not None:
            if existing.parent_node == parent.node and existing.tokens == tokens:
                return existing.pos
            return None
        pos = ChainPos(digest, self._next_node)
        self._next_node += 1
        page = CachedPage(block_id=block_id, tokens=tokens, parent_node=parent.node, pos=pos, index=index)
        self._by_hash[digest] = page
        self._by_block[block_id] = page
        self._by_node[pos.node] = page
        self._children_moved(page, +1)
        return pos

    def evict(self, block_id: int) -> int:
        """Forget the page held by ``block_id`` (its block is about to be overwritten);
        returns its node id."""
        page = self._by_block.pop(block_id)
        del self._by_hash[page.pos.hash]
        del self._by_node[page.pos.node]
        self._children_moved(page, -1)
        return page.pos.node

    def evict_host(self, host_page: int) -> int:
        """Forget the page kept in ``host_page``; returns its node id."""
        page = self._by_host.pop(host_page)
        del self._by_hash[page.pos.hash]
        del self._by_node[page.pos.node]
        return page.pos.node

    def to_host(self, block_id: int, host_page: int) -> None:
        """The page in ``block_id`` now lives in ``host_page`` (its block will be reused)."""
        page = self._by_block.pop(block_id)
        self._children_moved(page, -1)
        self._relocate(page, None, host_page)

    def to_device(self, host_page: int, block_id: int) -> None:
        """The page in ``host_page`` now lives in ``block_id`` again."""
        page = self._by_host.pop(host_page)
        self._children_moved(page, +1)
        self._relocate(page, block_id, None)

    def _relocate(self, page: CachedPage, block_id: Optional[int], host_page: Optional[int]) -> None:
        moved = replace(page, block_id=block_id, host_page=host_page)
        self._by_hash[page.pos.hash] = moved
        self._by_node[page.pos.node] = moved
        if block_id is not None:
            self._by_block[block_id] = moved
        else:
            self._by_host[host_page] = moved
