"""The quantized-KV write fused into the q/k norm + RoPE pass: one launch where the
unfused path takes two (:func:`ninfer_kernels.kv_quant.norm_rope_write_quant`).

One program per token: its query heads and key heads are normalised and rotated by the
q/k norm kernel's helper (``_norm_rope_token``); the keys go to a small scratch tensor in the activation dtype
(the unfused path rounds them there too), and after a block barrier the same program
reads each key head back with its value head and stores both quantized, exactly as the
write kernel does. The scratch round trip stays in L2; it saves working the quantizer
on the halves-and-tail layout the norm helper keeps in registers.
"""

from __future__ import annotations

from typing import Sequence

import torch
import triton
import triton.language as tl

from ninfer_kernels import kv_quant as ref
from ninfer_kernels.triton.kv_quant import _format_id, _store_kv_head, part_strides
from ninfer_kernels.triton.qk_norm_rope import _norm_rope_token, check_rotary_dim


@triton.jit
def _norm_rope_write_kernel(
    q_ptr, k_ptr, v_ptr, q_out_ptr, k_tmp_ptr, qw_ptr, kw_ptr, pos_ptr, cos_sin_ptr, slot_ptr,
    kd_ptr, ks_ptr, vd_ptr, vs_ptr, k_inv_gscale, v_inv_gscale,
    num_q_heads, num_k_heads, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_cs, eps,
    s_kdb, s_kds, s_kdh, s_kdd, s_ksb, s_kss, s_ksh, s_vdb, s_vds, s_vdh, s_vdd, s_vsb, s_vss, s_vsh,
    HALF: tl.constexpr, ROT: tl.constexpr, HEAD_D: tl.constexpr,
    BLOCK_QH: tl.constexpr, BLOCK_KH: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_TAIL: tl.constexpr,
    KFMT: tl.constexpr, VFMT: tl.constexpr, KGROUP: tl.constexpr, VGROUP: tl.constexpr, PAGE: tl.constexpr,
):
    token = tl.program_id(0)
    _norm_rope_token(q_ptr, k_ptr, q_out_ptr, k_tmp_ptr, qw_ptr, kw_ptr, pos_ptr, cos_sin_ptr, token,
                     num_q_heads, num_k_heads, stride_qt, stride_qh, stride_kt, stride_kh, stride_cs, eps,
                     HALF, ROT, HEAD_D, BLOCK_QH, BLOCK_KH, BLOCK_HALF, BLOCK_TAIL)
    tl.debug_barrier()  # this program's key rows, stored by all its threads, are read back below
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:  # padding rows store nothing
        return
    d = tl.arange(0, HEAD_D)
    d_ok = d < HEAD_D
    t = token.to(tl.int64)
    strides = (s_kdb, s_kds, s_kdh, s_kdd, s_ksb, s_kss, s_ksh, s_vdb, s_vds, s_vdh, s_vdd, s_vsb, s_vss, s_vsh)
    for h in range(num_k_heads):
        k = tl.load(k_tmp_ptr + (t * num_k_heads + h) * HEAD_D + d).to(tl.float32)
        v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d).to(tl.float32)
        _store_kv_head(k, v, d, d_ok, slot, h, kd_ptr, ks_ptr, vd_ptr, vs_ptr, k_inv_gscale, v_inv_gscale, strides,
                       KFMT, VFMT, HEAD_D, HEAD_D, KGROUP, VGROUP, PAGE)


def norm_rope_write_quant(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, norm_rope,
                          k_parts: Sequence[torch.Tensor], v_parts: Sequence[torch.Tensor], k_codec: ref.KVCodec,
                          v_codec: ref.KVCodec, slot_mapping: torch.Tensor) -> torch.Tensor:
    """Same contract as the reference."""
    n = norm_rope
    num_tokens, num_q_heads, head_dim = q.shape
    num_k_heads = k.shape[1]
    check_rotary_dim(n.rotary_dim, head_dim, n.cos_sin)
    if head_dim & (head_dim - 1) or head_dim < 16 or v.shape[-1] != head_dim:
        raise ValueError(f"quantized KV kernels need one power-of-two head dim >= 16, got {head_dim} and "
                         f"{v.shape[-1]}")
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if num_tokens == 0:
        return q_out
    k_tmp = torch.empty(num_tokens, num_k_heads, head_dim, dtype=k.dtype, device=k.device)
    half, tail = n.rotary_dim // 2, head_dim - n.rotary_dim
    _norm_rope_write_kernel[(num_tokens,)](
        q, k, v, q_out, k_tmp, n.q_weight.contiguous(), n.k_weight.contiguous(), n.positions, n.cos_sin.contiguous(),
        slot_mapping, *k_parts, *v_parts, 1.0 / k_codec.global_scale, 1.0 / v_codec.global_scale,
        num_q_heads, num_k_heads, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        n.cos_sin.stride(0), n.eps, *part_strides(k_parts), *part_strides(v_parts),
        HALF=half, ROT=n.rotary_dim, HEAD_D=head_dim,
        BLOCK_QH=triton.next_power_of_2(num_q_heads), BLOCK_KH=triton.next_power_of_2(num_k_heads),
        BLOCK_HALF=triton.next_power_of_2(half), BLOCK_TAIL=triton.next_power_of_2(tail) if tail else 0,
        KFMT=_format_id(k_codec), VFMT=_format_id(v_codec),
        KGROUP=k_codec.group(head_dim), VGROUP=v_codec.group(head_dim), PAGE=k_parts[0].shape[1], num_warps=4,
    )
    return q_out
