"""Gated RMSNorm in Triton: one pass over ``x`` and ``gate`` instead of about ten torch ops.

After a prefill chunk's delta rule, ``x`` is [T, Hv, Dv] and the gate ``z`` a column
slice of the input projection: both are taken as strided views (``z.unflatten(-1, (Hv,
Dv))`` needs no copy, where ``z.reshape(-1, Dv)`` makes one). Rows are short (Dv = 128),
so one program normalises several. The rounding steps are the reference's
(:func:`ninfer_kernels.gated_rms_norm.gated_rms_norm`); ``rsqrt`` and ``exp`` are the
GPU's, so results can differ from torch's in the last bit before the final rounding.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

#: elements one program aims to hold (rows x row width), as in the RMSNorm kernel
TILE_ELEMENTS = 4096


@triton.jit
def _gated_rms_norm_kernel(
    x_ptr, g_ptr, w_ptr, out_ptr,
    num_rows, inner, eps,
    stride_x0, stride_x1, stride_g0, stride_g1,
    D: tl.constexpr, BLOCK_D: tl.constexpr, ROWS: tl.constexpr, ROUND_SCALE: tl.constexpr,
):
    # Row r is element (r // inner, r % inner) of the inputs' two leading dimensions.
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    r0 = (r // inner).to(tl.int64)
    r1 = (r % inner).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    mask = (r < num_rows)[:, None] & (cols < D)[None, :]
    w = tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)
    x = tl.load(x_ptr + (r0 * stride_x0 + r1 * stride_x1)[:, None] + cols[None, :], mask=mask, other=0.0)
    g = tl.load(g_ptr + (r0 * stride_g0 + r1 * stride_g1)[:, None] + cols[None, :], mask=mask, other=0.0)
    xf = x.to(tl.float32)
    inv_rms = tl.math.rsqrt(tl.sum(xf * xf, 1) / D + eps)
    dtype = x_ptr.dtype.element_ty
    normed = (xf * inv_rms[:, None]).to(dtype).to(tl.float32)
    scaled = w[None, :] * normed
    if ROUND_SCALE:  # torch rounds ``weight * normed`` to bfloat16/float16 unless one side is float32
        scaled = scaled.to(dtype).to(tl.float32)
    gf = g.to(tl.float32)
    y = scaled * (gf / (1.0 + tl.exp(-gf)))
    tl.store(out_ptr + r.to(tl.int64)[:, None] * D + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)


def _as_3d(t: torch.Tensor) -> torch.Tensor:
    """``t`` as [A, B, D] without copying where the layout allows; last dim unit-stride."""
    if t.stride(-1) != 1:
        t = t.contiguous()
    if t.dim() == 1:
        return t[None, None]
    if t.dim() == 2:
        return t[None]
    return t.reshape(-1, *t.shape[-2:])


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Same contract as :func:`ninfer_kernels.gated_rms_norm.gated_rms_norm`; the result is a
    new contiguous tensor. ``x`` and ``gate`` may be strided views of the same shape."""
    if gate.shape != x.shape:
        raise ValueError(f"gate {tuple(gate.shape)} and x {tuple(x.shape)} must have the same shape")
    d = x.shape[-1]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    x3, g3 = _as_3d(x), _as_3d(gate)
    num_rows = x3.shape[0] * x3.shape[1]
    if num_rows == 0:
        return out
    block_d = triton.next_power_of_2(d)
    rows = max(1, min(64, TILE_ELEMENTS // block_d))
    round_scale = torch.promote_types(weight.dtype, x.dtype) == x.dtype and x.dtype != torch.float32
    _gated_rms_norm_kernel[(triton.cdiv(num_rows, rows),)](
        x3, g3, weight.contiguous(), out,
        num_rows, x3.shape[1], eps,
        x3.stride(0), x3.stride(1), g3.stride(0), g3.stride(1),
        D=d, BLOCK_D=block_d, ROWS=rows, ROUND_SCALE=round_scale,
        num_warps=min(16, max(1, rows * block_d // 512)),
    )
    return out
