"""Per-step batch metadata handed to the model and its attention layers."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

import torch

if TYPE_CHECKING:
    from ninfer.lora.layer import LoraBatch


@dataclass
class VerifyRows:
    """The speculative verify rows at the head of a batch, for layers with recurrent state.

    The first ``num_seqs`` sequences of the batch each bring ``width`` rows (the last
    committed token, then the drafts), laid out sequence-major; ``head`` is the batch of
    those sequences alone (their working state slots). A recurrent layer advances each
    sequence through its rows from its working slot, which it leaves untouched, and
    writes the state after position ``t`` to scratch row ``position_rows[i, t]``, so
    rejecting drafts is a copy back, never a recomputation. ``rest`` is the batch of the
    sequences after them (other decode rows, prefill chunks; None when there are none).
    """

    num_seqs: int
    width: int
    head: "ForwardBatch"
    position_rows: torch.Tensor  # int64 [num_seqs, width]
    rest: Optional["ForwardBatch"] = None

    @property
    def num_rows(self) -> int:
        return self.num_seqs * self.width


@dataclass
class ForwardBatch:
    """One engine step for B sequences, their new tokens laid out flat (varlen).

    Sequence ``i`` owns input rows ``query_start[i]:query_start[i+1]``. Those rows are
    the last ``q_len_i`` tokens of its context, so their positions run from
    ``seq_lens[i] - q_len_i`` to ``seq_lens[i] - 1``; attention for a row covers every
    cached token of the same sequence up to and including the row's own position.

    Device tensors drive kernels; the ``*_host`` lists mirror them so the CPU
    reference path never needs a device-to-host copy.
    """

    query_start: torch.Tensor  # int32 [B + 1], cumulative new-token counts
    seq_lens: torch.Tensor  # int32 [B] (int64 in replayed decode graphs), context incl. this step's tokens
    block_tables: torch.Tensor  # int32 [B, max_blocks]; unused entries are 0
    slot_mapping: torch.Tensor  # int64 [T], flat KV slot (block * block_size + offset); -1 = skip
    logits_indices: torch.Tensor  # int64 [N], rows whose logits the sampler needs
    block_size: int
    max_query_len: int
    max_seq_len: int
    query_lens_host: list[int] = field(default_factory=list)
    seq_lens_host: list[int] = field(default_factory=list)
    lora: Optional[LoraBatch] = None  # rows per LoRA adapter; None when no row uses one
    #: int64 [B] recurrent-state slot per sequence (hybrid families; None otherwise). A
    #: sequence whose chunk starts at position 0 starts from a zero state; any other
    #: chunk continues from what its slot holds.
    state_slots: Optional[torch.Tensor] = None
    #: speculative verify rows, laid out for recurrent layers (None: no such rows, or no state)
    verify: Optional[VerifyRows] = None
    #: every sequence brings exactly this many rows (0: not said): verify steps and the MTP
    #: head's drafting say so, and their attention may then take the one-launch decode path
    #: (prefill chunks never do, so short prompts compile no variants of it inside requests)
    rows_per_seq: int = 0

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_host)

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1
