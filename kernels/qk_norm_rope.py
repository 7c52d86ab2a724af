"""Reference for the fused per-head q/k RMSNorm followed by RoPE (Qwen3 attention).

Qwen3 normalises every query and key head before rotating it. Fusing the two norms and
the rotation into one pass saves two kernel launches per layer, which matters in a
decode step made of hundreds of small kernels.
"""

from __future__ import annotations

import torch

from ninfer_kernels.norm import rms_norm
from ninfer_kernels.rope import apply_rope


def qk_norm_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    rotary_dim: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``apply_rope(rms_norm(q), rms_norm(k))`` for q [T, H, D] and k [T, Hk, D] (views allowed)."""
    return apply_rope(rms_norm(q, q_weight, eps), rms_norm(k, k_weight, eps), positions, cos_sin, rotary_dim)
