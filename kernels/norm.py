"""Reference RMSNorm, optionally fused with the residual add that precedes it."""

from __future__ import annotations

import torch
import torch.nn.functional as F


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


#: decode batches up to this many tokens may take :func:`rms_norm_router`'s one launch on
#: CUDA (each of its programs reads its token's rows; past this the two launches serve)
NORM_ROUTER_MAX_TOKENS = 16


def rms_norm_router(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    router: torch.Tensor,
    shared_gate: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A MoE block's input norm and its router's matmul, from the pre-norm sum: ``(out,
    new_residual)`` as :func:`rms_norm` gives them for ``x + residual``, and the router's
    logits ``out @ router.T`` [T, E] in ``x``'s dtype, as the router's linear layer gives
    them. With ``shared_gate`` ([H], the shared expert's gate row) its logit follows as
    column ``E`` (rounded the same way; :func:`ninfer_kernels.moe.moe_route` with
    ``gate_in_logits`` reads it there)."""
    out, new_residual = rms_norm(x, weight, eps, residual)
    logits = F.linear(out, router)
    if shared_gate is not None:  # as moe_route takes it from x: the dot in float32, rounded
        gate = (out.float() @ shared_gate.reshape(-1).float()).to(out.dtype)
        logits = torch.cat([logits, gate[:, None]], dim=1)
    return out, new_residual, logits
