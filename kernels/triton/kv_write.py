"""Scatter new K/V rows into their cache pages, in Triton.

Padding rows (slot -1) are skipped by masking inside the kernel: the reference
selects the kept rows with a boolean index, which needs the count on the host and so
syncs; this launch never does, so it can sit inside a captured CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, num_heads,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
    PAGE: tl.constexpr, HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    page = slot // PAGE
    offset = slot % PAGE
    heads = tl.arange(0, BLOCK_H)
    # A padding row (slot -1) writes no heads at all.
    h_ok = heads < tl.where(slot >= 0, num_heads, 0)

    d = tl.arange(0, BLOCK_D)
    mask = h_ok[:, None] & (d < HEAD_D)[None, :]
    k = tl.load(k_ptr + token * stride_kt + heads[:, None] * stride_kh + d[None, :], mask=mask)
    dest = k_cache_ptr + page * stride_kcb + offset * stride_kcs + heads[:, None] * stride_kch + d[None, :]
    tl.store(dest, k.to(k_cache_ptr.dtype.element_ty), mask=mask)

    dv = tl.arange(0, BLOCK_DV)
    mask = h_ok[:, None] & (dv < HEAD_DV)[None, :]
    v = tl.load(v_ptr + token * stride_vt + heads[:, None] * stride_vh + dv[None, :], mask=mask)
    dest = v_cache_ptr + page * stride_vcb + offset * stride_vcs + heads[:, None] * stride_vch + dv[None, :]
    tl.store(dest, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Same contract as :func:`ninfer_kernels.attention.write_kv`: in place, slot -1 skipped."""
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("K/V caches must be contiguous in their last dimension")
    k = k if k.stride(-1) == 1 else k.contiguous()
    v = v if v.stride(-1) == 1 else v.contiguous()
    num_tokens, num_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    _write_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping, num_heads,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        PAGE=k_cache.shape[1], HEAD_D=head_dim, HEAD_DV=v.shape[-1],
        BLOCK_H=triton.next_power_of_2(num_heads), BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_DV=triton.next_power_of_2(v.shape[-1]),
        num_warps=4,
    )
