"""Recurrent-state slots: which running sequence owns which row of the model's state pool.

Hybrid families keep per-sequence state outside the paged KV cache (Gated DeltaNet's
conv history and delta-rule matrices), in pools with one row per slot. The scheduler
takes a slot when it admits a sequence and gives it back when the sequence finishes,
is aborted or fails, so every running sequence holds exactly one. A fresh owner needs
no clearing: a chunk that starts at position 0 ignores what its slot held.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Optional

from ninfer.engine.sequence import Sequence
from ninfer.engine.spec.scratch import VerifyScratch
from ninfer.engine.state_cache import StateSnapshots


class StateSlots:
    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"need at least one state slot, got {num_slots}")
        self.num_slots = num_slots
        self._free: deque[int] = deque(range(num_slots))
        self._owner: dict[int, int] = {}  # slot -> seq id

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_slots - self.num_free

    def can_take(self) -> bool:
        return bool(self._free)

    def take(self, seq: Sequence) -> int:
        """Give ``seq`` a free slot (recorded in ``seq.state_slot``)."""
        if seq.state_slot is not None:
            raise RuntimeError(f"sequence {seq.seq_id} already holds state slot {seq.state_slot}")
        if not self._free:
            raise RuntimeError("no free state slot")
        slot = self._free.popleft()
        self._owner[slot] = seq.seq_id
        seq.state_slot = slot
        return slot

    def release(self, seq: Sequence) -> None:
        """Return ``seq``'s slot, if it holds one; safe to call more than once."""
        slot = seq.state_slot
        if slot is None:
            return
        if self._owner.get(slot) != seq.seq_id:
            raise RuntimeError(f"sequence {seq.seq_id} releases state slot {slot}, which it does not own")
        del self._owner[slot]
        self._free.append(slot)
        seq.state_slot = None


@dataclass(frozen=True)
class RecurrentState:
    """What the scheduler is given for a model with recurrent state: the working slots and,
    when prefix reuse is on, the snapshots a cached prefix resumes from.

    Without snapshots a cached prefix could not be resumed, so prefix reuse is off for
    such a model (:func:`ninfer.engine.parts.prefix_reuse_on`). ``scratch`` holds the
    per-position state of speculative verify rows.
    """

    slots: StateSlots
    snapshots: Optional[StateSnapshots] = None
    #: per-position rows for speculative verify steps (None: no speculation)
    scratch: Optional[VerifyScratch] = None
