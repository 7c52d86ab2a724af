"""The order in which free cached pages give their device blocks back.

A free page that still holds published content is kept until a fresh block is needed.
Which one goes first is a cost comparison (:mod:`ninfer.engine.context_cost`):

1. pages no checkpoint retains (:mod:`ninfer.engine.context_cache`) go first, least
   recently freed first, as plain LRU would have it: nothing says they will be read again;
2. then retained pages, the one cheapest to recompute first (every page is the same
   size, so that is also the cheapest per byte freed). Only a *leaf* is a candidate (a
   page with no cached child on the device): dropping a page in the middle of a chain
   would strand every page after it, so chains shrink from their tail, and a shallow
   conversation's tail goes before a deep one's, whose tokens cost more to recompute.

The retained class is a heap with lazy deletion: an entry is checked when it comes out
(still free, still retained, still a leaf, the same occupant) and skipped otherwise.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from typing import Callable


class ReclaimOrder:
    """Free cached device blocks, and which one to reclaim next."""

    def __init__(self, cost: Callable[[int], float], is_leaf: Callable[[int], bool]) -> None:
        self._cost = cost  # recompute cost of the page a block holds
        self._is_leaf = is_leaf
        self._plain: OrderedDict[int, None] = OrderedDict()  # not retained, least recently freed first
        self._heap: list[tuple[float, int, int]] = []  # (cost, version, block)
        # retained free blocks -> version of their current heap entry (its keys: the retained set)
        self._version: dict[int, int] = {}
        self._versions = 0

    def __len__(self) -> int:
        return len(self._plain) + len(self._version)

    def __contains__(self, block: int) -> bool:
        return block in self._plain or block in self._version

    @property
    def num_retained(self) -> int:
        return len(self._version)

    def add(self, block: int, retained: bool) -> None:
        """``block`` became free and keeps its published page."""
        if retained:
            self._push(block)
        else:
            self._plain[block] = None

    def remove(self, block: int) -> None:
        """``block`` is claimed again (a hit) or its page was dropped."""
        if self._plain.pop(block, 0) is None:
            return
        self._version.pop(block, None)

    def set_retained(self, block: int, retained: bool) -> None:
        """A checkpoint started or stopped retaining the page in ``block`` (free or not)."""
        if retained and block in self._plain:
            del self._plain[block]
            self.add(block, True)
        elif not retained and block in self._version:
            del self._version[block]
            self._plain[block] = None
            self._plain.move_to_end(block, last=False)  # nobody wants it: first to go

    def candidate(self, block: int) -> None:
        """``block`` (free, retained) may have become a leaf: enter it in the heap again."""
        if block in self._version:
            self._push(block)

    def _push(self, block: int) -> None:
        self._versions += 1
        self._version[block] = self._versions
        heapq.heappush(self._heap, (self._cost(block), self._versions, block))
        if len(self._heap) > 4 * len(self._version) + 64:
            self._compact()

    def pop(self) -> int:
        """The block to reclaim next (the caller forgets or spills its page)."""
        if self._plain:
            block, _ = self._plain.popitem(last=False)
            return block
        while self._heap:
            _, version, block = heapq.heappop(self._heap)
            if self._version.get(block) == version and self._is_leaf(block):
                self.remove(block)
                return block
        if not self._version:
            raise IndexError("no free cached block")
        block = min(self._version, key=self._cost)  # no leaf among them: a chain some running request extends
        self.remove(block)
        return block

    def _compact(self) -> None:
        self._heap = [(c, v, b) for c, v, b in self._heap if self._version.get(b) == v]
        heapq.heapify(self._heap)
