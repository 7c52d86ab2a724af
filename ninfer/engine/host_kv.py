"""The host tier of the KV pool: evicted prefix pages kept in host memory.

When the block manager has to overwrite a cached page (published, no longer in use),
it first copies the page here and keeps its prefix-cache entry; a later hit copies it
back into a fresh device block. Host pages are pinned on CUDA so both copies run
asynchronously. Every copy is issued on the current stream, so it is ordered after
the step that wrote the page and before any step that reads or overwrites it; the
host never waits.

Copies are queued and issued by :meth:`HostKVTier.flush`, which the block manager calls
once an admission has taken its blocks: an 8k prompt admitted into a full pool evicts
512 pages at once, and page by page that was one copy per page and device tensor (10,240
launches on the 35B-A3B, 16,384 on the 27B). Flushed, each run of pages bound for
consecutive host rows is one gather and one copy per device tensor. The queue keeps its
order, so a page stored and then restored (or the other way round) in one admission sees
each copy happen as it was asked for.

Memory comes in slabs, allocated the first time they are needed: the configured
budget (8 GiB by default) is an upper bound, not a startup cost.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Optional

import torch

#: host memory allocated at a time
SLAB_BYTES = 64 << 20
#: the two kinds of queued copy
STORE, RESTORE = "store", "restore"


class HostKVTier:
    """Up to ``max_bytes`` of host copies of device pages. When full, the oldest copy no
    context-cache checkpoint retains leaves first; retained copies only when none is left
    (docs/context-cache.md)."""

    def __init__(self, page_tensors: list[torch.Tensor], max_bytes: int, pin: Optional[bool] = None) -> None:
        if not page_tensors:
            raise ValueError("a host KV tier needs the device page tensors")
        self._device = page_tensors
        self.page_bytes = sum(t.nbytes // t.shape[0] for t in page_tensors)
        self.capacity = max_bytes // self.page_bytes
        self.pin = page_tensors[0].device.type == "cuda" if pin is None else pin
        self._slab_pages = max(1, min(SLAB_BYTES // self.page_bytes, self.capacity))
        self._slabs: list[list[torch.Tensor]] = []
        self._free: list[int] = []
        self._lru: OrderedDict[int, None] = OrderedDict()  # stored pages that may be evicted, oldest first
        self._kept: OrderedDict[int, None] = OrderedDict()  # ...of those, pages a checkpoint retains
        self._held: set[int] = set()  # stored pages an admission is about to restore
        self._queue: list[tuple[str, int, int]] = []  # (kind, host page, device block), not yet issued

    @property
    def num_pages(self) -> int:
        """Pages holding a copy."""
        return len(self._lru) + len(self._kept) + len(self._held)

    @property
    def allocated_bytes(self) -> int:
        return sum(t.nbytes for slab in self._slabs for t in slab)

    def store(self, block_id: int, retained: bool = False) -> tuple[Optional[int], Optional[int]]:
        """Copy device page ``block_id`` to the host.

        Returns ``(host page, evicted host page)``: the page it went to (None when the
        tier has no room at all) and the page whose older copy was dropped to make
        room (None when none was), which the caller must forget.
        """
        victim = None
        if not self._free and not self._grow():
            pool = self._lru or self._kept
            if not pool:
                return None, None
            victim, _ = pool.popitem(last=False)
            self._free.append(victim)
        page = self._free.pop()
        self._queue.append((STORE, page, block_id))
        (self._kept if retained else self._lru)[page] = None
        return page, victim

    def set_retained(self, page: int, retained: bool) -> None:
        """A checkpoint now retains stored ``page`` (or no longer does): it moves to the newest
        end of the other queue (held pages are not in either)."""
        source, target = (self._lru, self._kept) if retained else (self._kept, self._lru)
        if page in source:
            del source[page]
            target[page] = None

    def hold(self, page: int) -> None:
        """Keep ``page`` from eviction until it is restored (an admission has matched it)."""
        (self._lru if page in self._lru else self._kept).pop(page)
        self._held.add(page)

    def restore(self, page: int, block_id: int) -> None:
        """Copy ``page`` into device page ``block_id`` (at the next :meth:`flush`) and free
        the host page."""
        self._queue.append((RESTORE, page, block_id))
        if page in self._held:
            self._held.remove(page)
        else:
            (self._lru if page in self._lru else self._kept).pop(page)
        self._free.append(page)

    def read(self, page: int) -> list[torch.Tensor]:
        """The host rows of ``page`` (one per device tensor), queued copies issued first; for
        inspection and tests."""
        self.flush()
        return self._rows(page)

    def flush(self) -> None:
        """Issue the queued copies in their order, each run of one kind to consecutive host
        rows of one slab as one gather (or slice) and one copy per device tensor."""
        queue, self._queue = self._queue, []
        start = 0
        for end in range(1, len(queue) + 1):
            if end == len(queue) or not self._continues(queue[end - 1], queue[end]):
                self._copy_run(queue[start:end])
                start = end

    def _continues(self, prev: tuple[str, int, int], op: tuple[str, int, int]) -> bool:
        """Whether ``op`` joins the run ``prev`` ends: same kind, the next host row of its slab."""
        return op[0] == prev[0] and op[1] == prev[1] + 1 and op[1] % self._slab_pages != 0

    def _copy_run(self, run: list[tuple[str, int, int]]) -> None:
        kind, first, _ = run[0]
        slab, row = divmod(first, self._slab_pages)
        blocks = [block for _, _, block in run]
        if blocks == list(range(blocks[0], blocks[0] + len(blocks))):  # consecutive blocks: a slice
            index = slice(blocks[0], blocks[0] + len(blocks))
        else:
            index = torch.tensor(blocks, dtype=torch.int64).to(self._device[0].device, non_blocking=self.pin)
        for host, dev in zip(self._slabs[slab], self._device):
            rows = host[row : row + len(run)]
            if kind == STORE:
                rows.copy_(dev[index], non_blocking=self.pin)
            elif isinstance(index, slice):
                dev[index].copy_(rows, non_blocking=self.pin)
            else:
                dev.index_copy_(0, index, rows.to(dev.device, non_blocking=self.pin))

    def _rows(self, page: int) -> list[torch.Tensor]:
        slab, index = divmod(page, self._slab_pages)
        return [t[index] for t in self._slabs[slab]]

    def _grow(self) -> bool:
        first = len(self._slabs) * self._slab_pages
        count = min(self._slab_pages, self.capacity - first)
        if count <= 0:
            return False
        self._slabs.append(
            [torch.empty((count, *t.shape[1:]), dtype=t.dtype, pin_memory=self.pin) for t in self._device]
        )
        self._free.extend(reversed(range(first, first + count)))  # pop() hands out the lowest first
        return True
