"""Per-position recurrent state for speculative verify rows: how rejected drafts leave no trace.

Attention KV needs no undo: a rejected position's entry lies past the sequence's
computed length, is never read and is overwritten by the next round. Recurrent state
(Gated DeltaNet's conv history and delta-rule matrices) is different, since every token
folds into it. A verify step therefore never advances a sequence's working slot: each
layer runs the sequence's ``width`` positions in one pass from the working slot and
stores the state after position ``t`` in a scratch row of its own (see
:class:`ninfer.model.forward_batch.VerifyRows` and ``gated_delta_verify`` in the
kernels). Once the host knows how many drafts were accepted, :meth:`VerifyScratch.settle`
copies the row of the last accepted position back into the working slot. This costs one
state write per position and no recomputation, and the state after any accepted prefix
is exactly the one plain decode would have reached (the same arithmetic advances it).

Scratch rows live after the working slots and the snapshot rows in the model's state
pools; each working slot owns ``width`` consecutive rows, and one last row takes the
writes of padding rows in a replayed verify graph.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
from ninfer_kernels import ops

from ninfer.engine.sampling_metadata import to_device


class VerifyScratch:
    """``banks`` sets of rows (two when device rounds run ahead while state snapshots are
    taken: see :mod:`ninfer.engine.spec.device_rounds`); host-driven rounds use bank 0."""

    def __init__(self, state_tensors: list[torch.Tensor], first_row: int, num_slots: int, width: int,
                 banks: int = 1):
        self._pools = state_tensors
        self.first_row, self.num_slots, self.width, self.banks = first_row, num_slots, width, banks

    @property
    def pools(self) -> list[torch.Tensor]:
        """The model's state pools these rows live in."""
        return self._pools

    @staticmethod
    def rows_needed(num_slots: int, width: int, banks: int = 1) -> int:
        return banks * num_slots * width + 1

    @property
    def bank_rows(self) -> int:
        """Rows from one bank's row to the same row of the next."""
        return self.num_slots * self.width

    @property
    def trash_row(self) -> int:
        """A row nobody reads: graph padding copies and advances its state here."""
        return self.first_row + self.banks * self.bank_rows

    def row(self, slot: int, position: int, bank: int = 0) -> int:
        """The scratch row holding ``slot``'s state after verify position ``position``."""
        if not 0 <= position < self.width:
            raise IndexError(f"verify position {position} outside 0..{self.width - 1}")
        return self.first_row + bank * self.bank_rows + slot * self.width + position

    def row_array(self, slots: np.ndarray, width: int) -> np.ndarray:
        """int64 [len(slots), width]: :meth:`row` of every slot and position below ``width``."""
        if width > self.width:
            raise IndexError(f"verify width {width} beyond the scratch rows' {self.width}")
        return self.first_row + slots[:, None] * self.width + np.arange(width)

    def settle(self, slots: Sequence[int], positions: Sequence[int]) -> None:
        """Working slot ``slots[i]`` takes the state after its verify position ``positions[i]``."""
        if not slots:
            return
        device = self._pools[0].device
        src = to_device([self.row(s, p) for s, p in zip(slots, positions)], torch.int64, device)
        ops.copy_state_rows(self._pools, src, to_device(list(slots), torch.int64, device))
