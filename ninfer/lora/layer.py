"""Applying several LoRA adapters to one batch in a linear layer (punica-style, plain torch).

A model's linear layer takes part by owning a ``lora`` attribute, None until an adapter
reaches it, and calling ``y = self.lora.apply(x, y)`` after its own matmul. The rows of
one step are grouped by adapter slot once per step (:class:`LoraBatch`); each layer then
runs one shrink/expand matmul pair per adapter present, never a loop over tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

#: the slot of requests without an adapter
NO_ADAPTER = 0


@dataclass(frozen=True)
class LoraBatch:
    """This step's rows per adapter slot present; ``rows`` None means every row of the step."""

    groups: tuple[tuple[int, Optional[torch.Tensor]], ...]

    @classmethod
    def build(
        cls, seq_slots: Sequence[int], query_lens: Sequence[int], device: torch.device
    ) -> Optional["LoraBatch"]:
        """Groups for sequences with adapter ``seq_slots`` owning ``query_lens`` consecutive rows.

        None when no sequence uses an adapter, so the layers skip LoRA entirely.
        """
        present = sorted(set(seq_slots) - {NO_ADAPTER})
        if not present:
            return None
        if len(present) == 1 and NO_ADAPTER not in seq_slots:
            return cls(((present[0], None),))
        token_slots = torch.repeat_interleave(torch.tensor(seq_slots), torch.tensor(query_lens))
        return cls(tuple((s, (token_slots == s).nonzero().flatten().to(device)) for s in present))


class LoraContext:
    """The step in flight, shared by every adapted layer of one model (None between steps)."""

    def __init__(self) -> None:
        self.batch: Optional[LoraBatch] = None


class LinearLora:
    """One linear layer's adapters, stacked by slot: ``a`` [S, R, in], ``b_t`` [S, R, out].

    ``b_t`` is ``B`` transposed with the adapter's scale folded in. Ranks are padded to
    the largest one loaded, but ``ranks[slot]`` says how many leading rows are real, so a
    slot only pays for its own rank. A fused layer (q/k/v, gate/up) stacks its parts'
    ``A`` rows and places each ``B`` on its own output columns.
    """

    def __init__(self, in_features: int, out_features: int, context: LoraContext, like: torch.Tensor):
        self.context = context
        self.a = like.new_zeros(1, 0, in_features)
        self.b_t = like.new_zeros(1, 0, out_features)
        self.ranks = [0]  # slot 0 (no adapter) stays empty

    def set_slot(self, slot: int, a: torch.Tensor, b_t: torch.Tensor) -> None:
        """Install ``a`` [r, in] and ``b_t`` [r, out] as ``slot``'s weights."""
        rank = a.shape[0]
        slots, width = max(slot + 1, self.a.shape[0]), max(rank, self.a.shape[1])
        if (slots, width) != self.a.shape[:2]:
            self.a = _grown(self.a, slots, width)
            self.b_t = _grown(self.b_t, slots, width)
            self.ranks += [0] * (slots - len(self.ranks))
        self.a[slot].zero_()
        self.b_t[slot].zero_()
        self.a[slot, :rank] = a.to(self.a)
        self.b_t[slot, :rank] = b_t.to(self.b_t)
        self.ranks[slot] = rank

    def apply(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``y`` (this layer's output for the flat rows ``x``) plus each row's adapter delta."""
        batch = self.context.batch
        if batch is None:
            return y
        for slot, rows in batch.groups:
            rank = self.ranks[slot] if slot < len(self.ranks) else 0
            if rank == 0:  # this adapter leaves the layer alone
                continue
            a, b_t = self.a[slot, :rank], self.b_t[slot, :rank]
            if rows is None:
                y.addmm_(x @ a.t(), b_t)
            else:
                y.index_add_(0, rows, (x.index_select(0, rows) @ a.t()) @ b_t)
        return y


def _grown(stack: torch.Tensor, slots: int, width: int) -> torch.Tensor:
    out = stack.new_zeros(slots, width, stack.shape[2])
    out[: stack.shape[0], : stack.shape[1]] = stack
    return out
