"""KV-cache storage formats (the ``kv_dtype`` plugin kind)."""

from __future__ import annotations

import abc
from typing import Callable

import attrs
import torch
from ninfer_kernels.attention import output_gate

from ninfer.model.forward_batch import ForwardBatch


class KVCache(abc.ABC):
    """The paged K/V store of one attention layer.

    Pages hold ``block_size`` tokens. A format decides how values are stored
    (plain, quantized with scales, ...) and therefore also how attention reads them.
    """

    @abc.abstractmethod
    def write(self, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Store new keys/values [T, num_kv_heads, head_dim] at flat slots [T] (-1 = skip)."""

    @abc.abstractmethod
    def attend(self, q: torch.Tensor, batch: ForwardBatch, scale: float) -> torch.Tensor:
        """Causal attention of queries [T, num_heads, head_dim] over the cached context."""

    def attend_gated(self, q: torch.Tensor, batch: ForwardBatch, scale: float, gate: torch.Tensor) -> torch.Tensor:
        """:meth:`attend` times ``sigmoid(gate)``, gated attention's output gate (``gate``
        [T, heads, Dv], a view of the projection). A format whose kernel can apply it as it
        stores the output overrides this (two launches fewer a layer)."""
        return output_gate(self.attend(q, batch, scale), gate)

    def decode_fused(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, norm_rope: HeadNormRope,
        batch: ForwardBatch, scale: float, gate: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """Optional fast path for decode batches (and others whose sequences each bring the
        same few rows, such as speculative verify rows: the format decides): take q/k/v
        straight from the projection, apply ``norm_rope``, store k/v and attend, all at
        once; the attention output, or None when this format has no such path for
        ``batch`` (the caller then does the steps one by one). A format that fuses must
        give what the steps give. With a ``gate`` (gated attention: [T, heads, Dv], a view
        of the projection) the output is ``attention * sigmoid(gate)``
        (:func:`ninfer_kernels.attention.output_gate`)."""
        return None

    @property
    def capturable(self) -> bool:
        """Whether :meth:`write` and :meth:`attend` may be captured in a CUDA graph: they
        read only device tensors of the batch, never its host-side lists."""
        return True

    @property
    @abc.abstractmethod
    def nbytes(self) -> int:
        """Device bytes held by this cache."""

    @abc.abstractmethod
    def page_tensors(self) -> list[torch.Tensor]:
        """Every tensor that holds page contents, each indexed by page along dim 0.

        Copying a page's row of each moves the page whole (values, and scales for a
        quantized format); the engine uses it to keep evicted pages on the host.
        """


@attrs.frozen(eq=False)
class HeadNormRope:
    """What happens to fresh q/k heads before they are cached and attended (Qwen3 style):
    a per-head RMSNorm with these weights, then RoPE of the first ``rotary_dim`` dims at
    ``positions`` from the ``cos_sin`` table (see ``ninfer_kernels.qk_norm_rope``)."""

    q_weight: torch.Tensor
    k_weight: torch.Tensor
    eps: float
    positions: torch.Tensor
    cos_sin: torch.Tensor
    rotary_dim: int


@attrs.frozen
class KVDtype:
    name: str
    description: str
    #: device bytes one token takes in one layer's cache, keys and values with their
    #: scales: (model dtype, num_kv_heads, head_dim) -> bytes (capacity planning)
    bytes_per_token: Callable[[torch.dtype, int, int], float]
    #: allocate(num_blocks, block_size, num_kv_heads, head_dim, model_dtype, device) -> KVCache
    allocate: Callable[..., KVCache]
