"""Triton per-head q/k RMSNorm + RoPE in one pass; see :mod:`ninfer_kernels.qk_norm_rope`.

One program per (token, head group): each head's row is loaded as its two rotary halves
and the pass-through tail, normalised in float32 with the head's weight, rotated, and
stored once. The inputs may be strided views of the fused qkv projection.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _norm_rope_heads(
    x_ptr, out_ptr, w_ptr, cos, sin, token, num_heads, stride_xt, stride_xh, eps,
    HALF: tl.constexpr, ROT: tl.constexpr, HEAD_D: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_TAIL: tl.constexpr,
):
    heads = tl.arange(0, BLOCK_H)
    offs = tl.arange(0, BLOCK_HALF)
    h_ok = heads < num_heads
    m = h_ok[:, None] & (offs < HALF)[None, :]
    src = x_ptr + token.to(tl.int64) * stride_xt + heads[:, None] * stride_xh
    dst = out_ptr + (token.to(tl.int64) * num_heads + heads[:, None]) * HEAD_D
    x1 = tl.load(src + offs[None, :], mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF + offs[None, :], mask=m, other=0.0).to(tl.float32)
    sq = tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)
    if BLOCK_TAIL > 0:
        tail = tl.arange(0, BLOCK_TAIL)
        mt = h_ok[:, None] & (tail < HEAD_D - ROT)[None, :]
        xt = tl.load(src + ROT + tail[None, :], mask=mt, other=0.0).to(tl.float32)
        sq += tl.sum(xt * xt, 1)
    inv = 1.0 / tl.sqrt(sq / HEAD_D + eps)
    w1 = tl.load(w_ptr + offs, mask=offs < HALF, other=0.0).to(tl.float32)
    w2 = tl.load(w_ptr + HALF + offs, mask=offs < HALF, other=0.0).to(tl.float32)
    # round the normalised value to the input dtype first, as the unfused norm does
    n1 = (x1 * inv[:, None] * w1[None, :]).to(out_ptr.dtype.element_ty).to(tl.float32)
    n2 = (x2 * inv[:, None] * w2[None, :]).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(dst + offs[None, :], (n1 * cos[None, :] - n2 * sin[None, :]).to(out_ptr.dtype.element_ty), mask=m)
    tl.store(dst + HALF + offs[None, :], (n2 * cos[None, :] + n1 * sin[None, :]).to(out_ptr.dtype.element_ty),
             mask=m)
    if BLOCK_TAIL > 0:
        wt = tl.load(w_ptr + ROT + tail, mask=tail < HEAD_D - ROT, other=0.0).to(tl.float32)
        tl.store(dst + ROT + tail[None, :], (xt * inv[:, None] * wt[None, :]).to(out_ptr.dtype.element_ty), mask=mt)


@triton.jit
def _qk_norm_rope_kernel(
    q_ptr, k_ptr, q_out_ptr, k_out_ptr, qw_ptr, kw_ptr, pos_ptr, cos_sin_ptr,
    num_q_heads, num_k_heads, stride_qt, stride_qh, stride_kt, stride_kh, stride_cs, eps,
    HALF: tl.constexpr, ROT: tl.constexpr, HEAD_D: tl.constexpr,
    BLOCK_QH: tl.constexpr, BLOCK_KH: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_TAIL: tl.constexpr,
):
    _norm_rope_token(q_ptr, k_ptr, q_out_ptr, k_out_ptr, qw_ptr, kw_ptr, pos_ptr, cos_sin_ptr, tl.program_id(0),
                     num_q_heads, num_k_heads, stride_qt, stride_qh, stride_kt, stride_kh, stride_cs, eps,
                     HALF, ROT, HEAD_D, BLOCK_QH, BLOCK_KH, BLOCK_HALF, BLOCK_TAIL)


@triton.jit
def _norm_rope_token(
    q_ptr, k_ptr, q_out_ptr, k_out_ptr, qw_ptr, kw_ptr, pos_ptr, cos_sin_ptr, token,
    num_q_heads, num_k_heads, stride_qt, stride_qh, stride_kt, stride_kh, stride_cs, eps,
    HALF: tl.constexpr, ROT: tl.constexpr, HEAD_D: tl.constexpr,
    BLOCK_QH: tl.constexpr, BLOCK_KH: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_TAIL: tl.constexpr,
):
    """One token's query and key heads, normalised and rotated."""
    offs = tl.arange(0, BLOCK_HALF)
    row = cos_sin_ptr + tl.load(pos_ptr + token).to(tl.int64) * stride_cs
    cos = tl.load(row + offs, mask=offs < HALF, other=0.0).to(tl.float32)
    sin = tl.load(row + HALF + offs, mask=offs < HALF, other=0.0).to(tl.float32)
    _norm_rope_heads(q_ptr, q_out_ptr, qw_ptr, cos, sin, token, num_q_heads, stride_qt, stride_qh, eps,
                     HALF, ROT, HEAD_D, BLOCK_QH, BLOCK_HALF, BLOCK_TAIL)
    _norm_rope_heads(k_ptr, k_out_ptr, kw_ptr, cos, sin, token, num_k_heads, stride_kt, stride_kh, eps,
                     HALF, ROT, HEAD_D, BLOCK_KH, BLOCK_HALF, BLOCK_TAIL)


def check_rotary_dim(rotary_dim: int, head_dim: int, cos_sin: torch.Tensor) -> None:
    """Raise unless ``rotary_dim`` is even, fits the head and matches the cos/sin table."""
    if cos_sin.shape[-1] != rotary_dim or rotary_dim > head_dim or rotary_dim % 2:
        raise ValueError(f"rotary_dim {rotary_dim} does not fit head_dim {head_dim} / cos_sin {cos_sin.shape[-1]}")


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
    """Same contract as the reference; returns new contiguous tensors."""
    num_tokens, num_q_heads, head_dim = q.shape
    check_rotary_dim(rotary_dim, head_dim, cos_sin)
    q = q if q.stride(-1) == 1 else q.contiguous()
    k = k if k.stride(-1) == 1 else k.contiguous()
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if num_tokens == 0:
        return q_out, k_out
    half, tail = rotary_dim // 2, head_dim - rotary_dim
    _qk_norm_rope_kernel[(num_tokens,)](
        q, k, q_out, k_out, q_weight.contiguous(), k_weight.contiguous(), positions, cos_sin.contiguous(),
        num_q_heads, k.shape[1], q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_sin.stride(0), eps,
        HALF=half, ROT=rotary_dim, HEAD_D=head_dim,
        BLOCK_QH=triton.next_power_of_2(num_q_heads), BLOCK_KH=triton.next_power_of_2(k.shape[1]),
        BLOCK_HALF=triton.next_power_of_2(half), BLOCK_TAIL=triton.next_power_of_2(tail) if tail else 0,
        num_warps=4,
    )
    return q_out, k_out
