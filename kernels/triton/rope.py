"""Rotary position embedding (rotate-half layout, partial rotary) in Triton.

One program per token rotates all of its query and key heads, so the token's cos/sin
row is read once and serves both. Results go to new tensors, like the reference:
callers may still hold the inputs (strided views of a fused QKV projection).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate_heads(
    src_ptr, dst_ptr, cos, sin, stride_t, stride_h, token, num_heads,
    HALF: tl.constexpr, ROT: tl.constexpr, HEAD_D: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_TAIL: tl.constexpr,
):
    heads = tl.arange(0, BLOCK_H)
    h_ok = heads < num_heads
    offs = tl.arange(0, BLOCK_HALF)
    mask = h_ok[:, None] & (offs < HALF)[None, :]
    src = src_ptr + token.to(tl.int64) * stride_t + heads[:, None] * stride_h
    # Destination is a contiguous [T, num_heads, HEAD_D] tensor.
    dst = dst_ptr + token.to(tl.int64) * num_heads * HEAD_D + heads[:, None] * HEAD_D
    x1 = tl.load(src + offs[None, :], mask=mask, other=0.0)
    x2 = tl.load(src + HALF + offs[None, :], mask=mask, other=0.0)
    x1f = x1.to(tl.float32)
    x2f = x2.to(tl.float32)
    tl.store(dst + offs[None, :], (x1f * cos[None, :] - x2f * sin[None, :]).to(x1.dtype), mask=mask)
    tl.store(dst + HALF + offs[None, :], (x2f * cos[None, :] + x1f * sin[None, :]).to(x1.dtype), mask=mask)
    if BLOCK_TAIL > 0:
        # Partial rotary: dims past ROT pass through unchanged.
        tail = tl.arange(0, BLOCK_TAIL)
        t_mask = h_ok[:, None] & (tail < HEAD_D - ROT)[None, :]
        rest = tl.load(src + ROT + tail[None, :], mask=t_mask, other=0.0)
        tl.store(dst + ROT + tail[None, :], rest, mask=t_mask)


@triton.jit
def _rope_kernel(
    q_ptr, k_ptr, q_out_ptr, k_out_ptr, pos_ptr, cos_sin_ptr,
    num_q_heads, num_k_heads, stride_qt, stride_qh, stride_kt, stride_kh, stride_cs,
    HALF: tl.constexpr, ROT: tl.constexpr, HEAD_D: tl.constexpr,
    BLOCK_QH: tl.constexpr, BLOCK_KH: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_TAIL: tl.constexpr,
):
    token = tl.program_id(0)
    offs = tl.arange(0, BLOCK_HALF)
    row = cos_sin_ptr + tl.load(pos_ptr + token).to(tl.int64) * stride_cs
    cos = tl.load(row + offs, mask=offs < HALF, other=0.0).to(tl.float32)
    sin = tl.load(row + HALF + offs, mask=offs < HALF, other=0.0).to(tl.float32)
    _rotate_heads(q_ptr, q_out_ptr, cos, sin, stride_qt, stride_qh, token, num_q_heads,
                  HALF, ROT, HEAD_D, BLOCK_QH, BLOCK_HALF, BLOCK_TAIL)
    _rotate_heads(k_ptr, k_out_ptr, cos, sin, stride_kt, stride_kh, token, num_k_heads,
                  HALF, ROT, HEAD_D, BLOCK_KH, BLOCK_HALF, BLOCK_TAIL)


def apply_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    rotary_dim: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as :func:`ninfer_kernels.rope.apply_rope`; returns new contiguous tensors."""
    if cos_sin.shape[-1] != rotary_dim:
        raise ValueError(f"cos_sin table has {cos_sin.shape[-1]} columns, expected rotary_dim={rotary_dim}")
    num_tokens, num_q_heads, head_dim = q.shape
    if k.shape[-1] != head_dim or rotary_dim > head_dim:
        raise ValueError(f"q/k head dims {head_dim}/{k.shape[-1]} do not fit rotary_dim={rotary_dim}")
    q = q if q.stride(-1) == 1 else q.contiguous()
    k = k if k.stride(-1) == 1 else k.contiguous()
    cos_sin = cos_sin if cos_sin.stride(-1) == 1 else cos_sin.contiguous()
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if num_tokens == 0:
        return q_out, k_out
    half = rotary_dim // 2
    tail = head_dim - rotary_dim
    _rope_kernel[(num_tokens,)](
        q, k, q_out, k_out, positions, cos_sin,
        num_q_heads, k.shape[1], q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_sin.stride(0),
        HALF=half, ROT=rotary_dim, HEAD_D=head_dim,
        BLOCK_QH=triton.next_power_of_2(num_q_heads), BLOCK_KH=triton.next_power_of_2(k.shape[1]),
        BLOCK_HALF=triton.next_power_of_2(half), BLOCK_TAIL=triton.next_power_of_2(tail) if tail else 0,
        num_warps=4,
    )
    return q_out, k_out
