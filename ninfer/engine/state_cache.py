"""Recurrent-state snapshots: what makes prefix reuse exact for hybrid families.

Cached KV pages cover only the attention layers; a sequence can resume after a cached
prefix only with the recurrent state at exactly that token. A snapshot is a copy of a
working state slot, taken when a sequence's computed frontier sits on the end of one
of its published pages, and keyed by that page's prefix-cache node id. Node ids are
never reused, so a key names one exact prefix (every token before it, and the LoRA
namespace); the block manager asks :meth:`StateSnapshots.has` which matched pages a
sequence may resume after, and tells :meth:`StateSnapshots.forget` when a page leaves
the cache for good.

Snapshot rows live in the model's own state pools, after the working slots; a pinned
host mirror takes the least recently used ones when the device rows are full, if
copying a snapshot out and back costs less than recomputing its prefix
(:mod:`ninfer.engine.context_cost`). Snapshots where a checkpoint ends
(:mod:`ninfer.engine.context_cache`, told through :meth:`StateSnapshots.keep`) leave
either tier only after every other one has. Copies
go through ``model.state_tensors()`` on the current stream (device rows through one
multi-pool row copy, ``ninfer_kernels.ops.copy_state_rows``), so they are ordered
against the steps that write the slots and never make the host wait.

Which frontiers are captured (the scheduler decides when, see :func:`capture_points`):
the prompt's deepest reusable boundaries, its turn closure and the boundaries the
client marked, kept until evicted, and while generating one
rolling snapshot per sequence that moves to each new page boundary; the one a finished
sequence leaves behind is its end-of-turn snapshot.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional

import torch
from ninfer_kernels import ops

from ninfer.engine.context_cost import DEFAULT_COSTS, ContextCosts
from ninfer.engine.sampling_metadata import to_device


def prompt_frontiers(num_prompt_tokens: int, block_size: int) -> tuple[int, ...]:
    """Page boundaries of a prompt worth a snapshot, shallowest first.

    A later request never reuses its own last prompt token, so the deepest boundary a
    repeat of this prompt can resume at is the last one before that token. The one a
    page earlier is kept too: a chat's next turn re-renders the previous prompt with
    a different tail (the generation prompt after the last message is replaced by the
    reply), and that tail often crosses the deepest boundary.
    """
    deepest = (num_prompt_tokens - 1) // block_size * block_size
    return tuple(f for f in (deepest - block_size, deepest) if f > 0)


def capture_points(seq, block_size: int) -> tuple[int, ...]:
    """Where a sequence's prompt prefill stops for a snapshot, shallowest first: the
    :func:`prompt_frontiers`, plus its turn closure and marked boundaries (page-rounded)
    so the checkpoints there (:mod:`ninfer.engine.context_cache`) can be resumed from."""
    points = set(prompt_frontiers(seq.num_prompt_tokens, block_size))
    hints = seq.cache_hints
    deepest = (seq.num_prompt_tokens - 1) // block_size * block_size
    for p in (hints.turn_closure or 0, *hints.shared):
        f = p // block_size * block_size
        if 0 < f <= deepest:
            points.add(f)
    return tuple(sorted(points))


@dataclass
class SnapshotStats:
    captures: int = 0  # state copies taken into a snapshot row
    device_hits: int = 0  # restores from a device row
    host_hits: int = 0  # restores from the host tier
    spills: int = 0  # device snapshots moved to the host tier to make room
    drops: int = 0  # snapshots discarded (no room anywhere, replaced, or their page forgotten)


class StateSnapshots:
    """Snapshot rows ``[first_row, first_row + num_device)`` of the state pools, plus
    ``num_host`` host rows; LRU on both tiers."""

    def __init__(
        self,
        state_tensors: list[torch.Tensor],
        first_row: int,
        num_device: int,
        num_host: int,
        pin: Optional[bool] = None,
        costs: ContextCosts = DEFAULT_COSTS,
    ) -> None:
        if num_device < 1:
            raise ValueError(f"need at least one device snapshot row, got {num_device}")
        rows = state_tensors[0].shape[0] if state_tensors else 0
        if not state_tensors or first_row + num_device > rows:
            raise ValueError(f"state pools of {rows} rows cannot hold {num_device} snapshot rows from row {first_row}")
        self._pools = state_tensors
        self.num_device, self.num_host = num_device, num_host
        self.pin = state_tensors[0].device.type == "cuda" if pin is None else pin
        self._host = [
            torch.empty((num_host, *t.shape[1:]), dtype=t.dtype, pin_memory=self.pin) for t in state_tensors
        ]
        self._free_device = list(reversed(range(first_row, first_row + num_device)))
        self._free_host = list(reversed(range(num_host)))
        self._on_device: OrderedDict[int, int] = OrderedDict()  # node -> pool row, least recent first
        self._on_host: OrderedDict[int, int] = OrderedDict()  # node -> host row, least recent first
        self._rolling: dict[int, int] = {}  # seq id -> node of its rolling snapshot
        self._roller: dict[int, int] = {}  # that node -> seq id
        self._tokens: dict[int, int] = {}  # node -> tokens its prefix holds (what recomputing it costs)
        self._kept: set[int] = set()  # nodes where a checkpoint ends
        self.costs = costs
        self.row_bytes = sum(t.nbytes // t.shape[0] for t in state_tensors)
        self.stats = SnapshotStats()

    @property
    def host_bytes(self) -> int:
        return sum(t.nbytes for t in self._host)

    def __len__(self) -> int:
        return len(self._on_device) + len(self._on_host)

    def where(self, node: int) -> Optional[str]:
        """"device", "host", or None when ``node`` has no snapshot."""
        return "device" if node in self._on_device else "host" if node in self._on_host else None

    def has(self, node: int) -> bool:
        return node in self._on_device or node in self._on_host

    def keep(self, node: int, checkpoint: bool) -> None:
        """A checkpoint now ends at ``node`` (or no longer does): its snapshot goes last."""
        if checkpoint:
            self._kept.add(node)
        else:
            self._kept.discard(node)

    # -- capture ------------------------------------------------------------------
    def capture(self, node: int, slot: int, roller: Optional[int] = None, tokens: int = 0) -> bool:
        """Snapshot working slot ``slot`` under ``node``; False when ``node`` already had one.

        ``roller``: the sequence whose rolling snapshot this is; its previous one is
        replaced (reusing that device row when it has one). ``tokens``: the prefix's length.
        """
        if tokens:
            self._tokens[node] = tokens
        if roller is not None and self._rolling.get(roller) == node:
            self._touch(node, adopt=False)  # the same frontier again: nothing new to copy
            return False
        previous = self._rolling.pop(roller, None) if roller is not None else None
        if previous is not None:
            del self._roller[previous]
            if previous in self._kept:  # a checkpoint ends there: it stays, as any snapshot does
                previous = None
        if self.has(node):
            self._touch(node)
            if previous is not None and previous != node:
                self._drop(previous)
            return False
        row = self._on_device.pop(previous) if previous in self._on_device else None
        if row is not None:
            self._tokens.pop(previous, None)
        if row is None:
            if previous is not None:
                self._drop(previous)
            row = self._device_row()
        self._copy_row(slot, row)
        self._on_device[node] = row
        if roller is not None:
            self._rolling[roller] = node
            self._roller[node] = roller
        self.stats.captures += 1
        return True

    def warm_up(self) -> None:
        """Run the row copy once, a row onto itself (which moves nothing), so its kernel is
        compiled before the first snapshot of a served request needs it."""
        first = self._free_device[-1] if self._free_device else next(iter(self._on_device.values()))
        self._copy_row(first, first)

    def _copy_row(self, src: int, dst: int) -> None:
        """Row ``src`` of every pool into row ``dst`` (one launch on CUDA, not two per pool)."""
        device = self._pools[0].device
        ops.copy_state_rows(self._pools, to_device([src], torch.int64, device), to_device([dst], torch.int64, device))

    def finish(self, seq_id: int) -> None:
        """``seq_id`` is done: its rolling snapshot stays, as the end of its turn."""
        node = self._rolling.pop(seq_id, None)
        if node is not None:
            del self._roller[node]

    def _victim(self, tier: OrderedDict) -> int:
        """The least recently used snapshot of ``tier`` that no checkpoint ends at, else the
        least recently used one."""
        for node in tier:
            if node not in self._kept:
                return node
        return next(iter(tier))

    def _device_row(self) -> int:
        if self._free_device:
            return self._free_device.pop()
        node = self._victim(self._on_device)
        row = self._on_device.pop(node)
        tokens = self._tokens.get(node)  # unknown: assume the copy pays
        if self.num_host and (tokens is None or self.costs.spill_pays(0, tokens, self.row_bytes)):
            if not self._free_host:
                self._drop(self._victim(self._on_host))
            host_row = self._free_host.pop()
            for pool, host in zip(self._pools, self._host):
                host[host_row].copy_(pool[row], non_blocking=self.pin)
            self._on_host[node] = host_row
            self.stats.spills += 1
        else:
            self._unroll(node)
            self._tokens.pop(node, None)
            self.stats.drops += 1
        return row

    # -- use ------------------------------------------------------------------------
    def restore(self, node: int, slot: int) -> None:
        """Copy the snapshot ``node`` into working slot ``slot``."""
        if node in self._on_device:
            self._copy_row(self._on_device[node], slot)
            self.stats.device_hits += 1
        else:
            row = self._on_host[node]
            for pool, host in zip(self._pools, self._host):
                pool[slot].copy_(host[row], non_blocking=self.pin)
            self.stats.host_hits += 1
        self._touch(node)

    def forget(self, node: int) -> None:
        """The page ``node`` left the prefix cache: its snapshot can never match again."""
        if self.has(node):
            self._drop(node)

    # -- bookkeeping ----------------------------------------------------------------
    def _touch(self, node: int, adopt: bool = True) -> None:
        """Mark ``node`` recently used. ``adopt``: another sequence found it useful, so it
        stops being its owner's rolling snapshot (the owner moving on must not drop it)."""
        (self._on_device if node in self._on_device else self._on_host).move_to_end(node)
        if adopt:
            self._unroll(node)

    def _unroll(self, node: int) -> None:
        seq_id = self._roller.pop(node, None)
        if seq_id is not None:
            del self._rolling[seq_id]

    def _drop(self, node: int) -> None:
        if node in self._on_device:
            self._free_device.append(self._on_device.pop(node))
        else:
            self._free_host.append(self._on_host.pop(node))
        self._unroll(node)
        self._tokens.pop(node, None)
        self.stats.drops += 1
