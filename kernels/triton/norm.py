"""RMSNorm in Triton, optionally fused with the residual add before it.

One pass reads ``x`` (and ``residual``), writes the normalised rows (and the new
residual sum): the unfused version would write the sum and read it back. Rows may
be strided views, such as per-head slices of a fused QKV projection, so the kernel
takes two row strides instead of asking for a contiguous copy.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ninfer_kernels.triton import pdl
from ninfer_kernels.triton.rounding import interpreted_bf16, round_to
from ninfer_kernels.triton.tuned_tables import forced

#: elements one program aims to hold (rows x row width): short rows are batched up
TILE_ELEMENTS = 4096


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, sum_ptr,
    num_rows, inner, eps,
    stride_x0, stride_x1, stride_r0, stride_r1,
    N: tl.constexpr, BLOCK_N: tl.constexpr, ROWS: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
    USE_PDL: tl.constexpr, PARTS: tl.constexpr = 1, ROUND: tl.constexpr = False,
):
    # Row r is element (r // inner, r % inner) of the input's two leading dimensions.
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    r_ok = r < num_rows
    r0 = (r // inner).to(tl.int64)
    r1 = (r % inner).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = r_ok[:, None] & (cols < N)[None, :]
    # The weight is never what the kernel before wrote: fetch it before waiting, so its
    # (usually uncached) read overlaps the wait instead of following the reduction.
    w = tl.load(w_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
    if USE_PDL:
        pdl.wait()  # x (and maybe the residual) comes from the kernel before
    if PARTS > 1:  # a MoE layer's rows, PARTS a token: summed in float32 and rounded, as sum_pairs does
        parts = tl.zeros([ROWS, BLOCK_N], dtype=tl.float32)
        for p in tl.static_range(PARTS):
            parts += tl.load(x_ptr + ((r0 * PARTS + p) * stride_x0)[:, None] + cols[None, :], mask=mask,
                             other=0.0).to(tl.float32)
        x = round_to(parts, x_ptr.dtype.element_ty, ROUND)
    else:
        x = tl.load(x_ptr + (r0 * stride_x0 + r1 * stride_x1)[:, None] + cols[None, :], mask=mask, other=0.0)
    # Outputs are contiguous [num_rows, N].
    dest = r.to(tl.int64)[:, None] * N + cols[None, :]
    if HAS_RESIDUAL:
        res = tl.load(res_ptr + (r0 * stride_r0 + r1 * stride_r1)[:, None] + cols[None, :], mask=mask, other=0.0)
        # Round the sum to the residual stream's dtype before normalising it, as the
        # reference does, so both paths carry the same residual forward.
        x = (x.to(tl.float32) + res.to(tl.float32)).to(sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + dest, x, mask=mask)
    xf = x.to(tl.float32)
    inv_rms = 1.0 / tl.sqrt(tl.sum(xf * xf, 1) / N + eps)
    tl.store(out_ptr + dest, (xf * inv_rms[:, None] * w[None, :]).to(out_ptr.dtype.element_ty), mask=mask)


def _as_3d(t: torch.Tensor) -> torch.Tensor:
    """``t`` as [A, B, N] without copying where the layout allows; last dim unit-stride."""
    if t.stride(-1) != 1:
        t = t.contiguous()
    if t.dim() == 1:
        return t[None, None]
    if t.dim() == 2:
        return t[None]
    return t.reshape(-1, *t.shape[-2:])


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    expert_rows: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Same contract as :func:`ninfer_kernels.norm.rms_norm`; results are new contiguous tensors."""
    n = x.shape[-1]
    shape = (*x.shape[:-2], n) if expert_rows else x.shape
    dtype = x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype)
    out = torch.empty(shape, dtype=dtype, device=x.device)
    new_residual = torch.empty_like(out) if residual is not None else out
    if out.numel() == 0:
        return out if residual is None else (out, new_residual)
    if expert_rows:  # [.., P, H]: a kernel row per token, its P rows summed in the load
        parts = x.shape[-2]
        rows = x.reshape(-1, n)
        res = residual.expand(shape).reshape(-1, n) if residual is not None else rows
        if res.stride(-1) != 1:
            res = res.contiguous()
        num_rows, inner = out.numel() // n, 1
        x_strides, r_strides = (rows.stride(0), 0), (res.stride(0), 0)
    else:
        parts = 1
        rows = _as_3d(x)
        res = _as_3d(residual.expand(x.shape)) if residual is not None else rows
        num_rows, inner = rows.shape[0] * rows.shape[1], rows.shape[1]
        x_strides, r_strides = (rows.stride(0), rows.stride(1)), (res.stride(0), res.stride(1))
    block_n = triton.next_power_of_2(n)
    per_program = max(1, min(64, TILE_ELEMENTS // block_n))
    if forced("NINFER_NORM_FIT"):  # (an A/B switch, read per call) no masked rows
        per_program = min(per_program, triton.next_power_of_2(num_rows))
    use_pdl = pdl.enabled(x.device)
    _rms_norm_kernel[(triton.cdiv(num_rows, per_program),)](
        rows, res, weight.contiguous(), out, new_residual, num_rows, inner, eps, *x_strides, *r_strides,
        N=n, BLOCK_N=block_n, ROWS=per_program, HAS_RESIDUAL=residual is not None, USE_PDL=use_pdl,
        PARTS=parts, ROUND=parts > 1 and interpreted_bf16(x),
        num_warps=min(16, max(1, per_program * block_n // 512)), **pdl.launch_options(use_pdl),
    )
    return out if residual is None else (out, new_residual)
