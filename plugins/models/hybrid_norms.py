"""The two norms of the hybrid Qwen families beyond plain RMSNorm.

Zero-centred RMSNorm scales by ``1 + w``, with ``w`` what the checkpoint stores (it is
initialised at zero). The parameter here holds ``1 + w`` in float32, added once at load
time: the shared RMSNorm kernels then apply it unchanged, and keeping float32 means a
bfloat16 model does not round ``1 + w`` (which would lose most of ``w``'s bits).

The gated RMSNorm normalises Gated DeltaNet's output per value head and multiplies by
``silu(z)`` of a separate gate projection; its weight is a plain scale.
"""

from __future__ import annotations

import torch
from torch import nn

from ninfer_kernels import ops
from ninfer_plugins.models.layers import RMSNorm, empty_param


class ZeroCentredRMSNorm(RMSNorm):
    def __init__(self, dim: int, eps: float):
        super().__init__(dim, eps)
        self.weight = nn.Parameter(torch.empty(dim, dtype=torch.float32), requires_grad=False)

    @staticmethod
    def from_checkpoint(tensor: torch.Tensor) -> torch.Tensor:
        """The stored parameter for a checkpoint tensor ``w``: ``1 + w`` in float32."""
        return tensor.float() + 1.0


class GatedRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = empty_param(dim)
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """``x``/``gate`` [..., dim] (views allowed): the norm in float32, rounded to ``x``'s
        dtype before the scale (transformers' order, so bfloat16 results agree), then the
        float32 gate (:func:`ninfer_kernels.gated_rms_norm.gated_rms_norm`)."""
        return ops.gated_rms_norm(x, gate, self.weight, self.eps)
