"""Reference gated RMSNorm: Gated DeltaNet's per-value-head norm, gated by ``silu(z)``.

The numerics are ``GatedRMSNorm.forward``'s (plugins/models/hybrid_norms.py; kernels
cannot import plugins): the norm in float32, rounded to ``x``'s dtype before the scale
(transformers' order, so bfloat16 results agree), ``weight * normed`` in torch's promoted
dtype (a bfloat16 weight rounds the product), then the float32 ``silu(gate)``, rounded
once more to ``x``'s dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x``, ``gate`` [..., D] (same shape), ``weight`` [D] -> [..., D] in ``x``'s dtype."""
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)).to(x.dtype)
    return (weight * normed * F.silu(gate.float())).to(x.dtype)
