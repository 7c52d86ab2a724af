"""Reference RMSNorm, optionally fused with the residual add that precedes it."""

from __future__ import annotations

import torch


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    expert_rows: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``x / rms(x) * weight`` over the last dimension.

    With ``residual`` given, ``x + residual`` is normalised instead and also returned,
    as ``(out, new_residual)``: decoder layers carry the running sum this way so a
    fused kernel can do the add and the norm in one pass. The add happens in ``x``'s
    dtype (the residual stream's precision); the norm in float32, rounded once at the end.

    ``expert_rows``: ``x`` [T, P, H] holds a mixture-of-experts layer's weighted rows per
    token (:func:`ninfer_kernels.moe.fused_moe` with ``summed`` false); they are summed in
    float32 and rounded first, exactly as the expert op would have, so the layer saves
    the launch and the round trip of that sum.
    """
    if expert_rows:
        x = x.float().sum(dim=-2).to(x.dtype)
    if residual is not None:
        x = x + residual
    xf = x.float()
    inv_rms = torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    out = (xf * inv_rms * weight.float()).to(x.dtype)
    return out if residual is None else (out, x)
