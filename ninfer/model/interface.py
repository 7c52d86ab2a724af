"""What a model family's module must provide to the engine."""

from __future__ import annotations

import abc
from typing import Iterable

import attrs
import torch
from torch import nn

from ninfer.model.forward_batch import ForwardBatch


@attrs.frozen
class AttentionSpec:
    """Shape of one attention layer's KV cache."""

    num_kv_heads: int
    head_dim: int


class CausalLM(nn.Module, abc.ABC):
    """A decoder-only language model over the paged KV cache.

    The engine allocates one KV cache per entry of :meth:`attention_specs` (through
    the selected KV-dtype plugin), hands them to :meth:`bind_kv_caches`, then calls
    :meth:`forward` once per step and :meth:`compute_logits` on the rows it samples.

    Models with recurrent layers (hybrid families) also keep fixed-size state per
    sequence outside the KV cache: the engine calls :meth:`allocate_state` once, gives
    each admitted sequence one slot, and passes the slots in ``ForwardBatch.state_slots``.
    Slots beyond the working ones hold snapshots the engine copies in and out through
    :meth:`state_tensors`.
    The defaults below describe a model without such state.
    """

    @abc.abstractmethod
    def attention_specs(self) -> list[AttentionSpec]:
        """One entry per layer that keeps a paged KV cache, in layer order."""

    @abc.abstractmethod
    def bind_kv_caches(self, caches: list) -> None:
        """Attach the allocated caches (same order as :meth:`attention_specs`)."""

    @abc.abstractmethod
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """``input_ids``/``positions``: int64 [T]. Returns final hidden states [T, hidden]."""

    @abc.abstractmethod
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Hidden rows [N, hidden] -> float32 logits [N, vocab]."""

    @abc.abstractmethod
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Consume checkpoint tensors by their Hugging Face names."""

    def state_bytes_per_slot(self) -> int:
        """Device bytes of recurrent state one sequence needs; 0 when the model keeps none."""
        return 0

    def allocate_state(self, num_slots: int, device: torch.device | str) -> int:
        """Allocate state for ``num_slots`` slots; returns the bytes taken."""
        return 0

    def state_tensors(self) -> list[torch.Tensor]:
        """Every per-slot state pool, each indexed by slot along dim 0.

        The engine copies whole slots through these (snapshots for prefix reuse, their
        host tier), so it needs no knowledge of what a family keeps per sequence.
        """
        return []
