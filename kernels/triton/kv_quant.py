"""Quantized KV caches on CUDA: the write that quantizes, and paged attention that
dequantizes as it loads; see :mod:`ninfer_kernels.kv_quant` for the formats.

The write runs one program per (token, KV head): the head's row, its scales, its codes,
stored where the reference stores them, rounded the same way (to nearest, ties to even).

Attention is :mod:`.paged_attention`'s kernel with another tile loader
(:mod:`.kv_quant_tiles`): each K/V tile is read in its stored form and dequantized in
registers for the tensor-core products, so the cache is never expanded in memory. Host
values only size the grid, so CUDA graphs can capture it.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
import triton
import triton.language as tl

from ninfer.model.forward_batch import ForwardBatch
from ninfer_kernels import kv_quant as ref
from ninfer_kernels.triton.decode_launch import DecodeLaunch, tuned_launch
from ninfer_kernels.triton.kv_quant_tiles import _attend_pages
from ninfer_kernels.triton.paged_attention import (
    MIN_KEYS_PER_SPLIT, _block_rows, _load_queries, _merge_kernel, _num_splits, _store_rows, _tiles,
)
from ninfer_kernels.triton.rounding import e2m1_half, round_e4m3, round_half_even

#: compile-time format ids
INT8, FP8, NVFP4 = 1, 2, 3
_IDS = {"int8": INT8, "fp8": FP8, "nvfp4": NVFP4}


def _format_id(codec: ref.KVCodec) -> int:
    if codec.name not in _IDS:
        raise ValueError(f"no CUDA kernel for KV codec {codec.name!r}")
    return _IDS[codec.name]


# -- the write -----------------------------------------------------------------------------------
@triton.jit
def _e2m1_code(y):
    """int32 e2m1 code of float32 ``y``: nearest magnitude (saturating at 6), ties to the even code."""
    a = tl.minimum(tl.abs(y), 6.0)
    idx = ((a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32) + (a > 1.25).to(tl.int32)
           + (a >= 1.75).to(tl.int32) + (a > 2.5).to(tl.int32) + (a >= 3.5).to(tl.int32) + (a > 5.0).to(tl.int32))
    return tl.where(y < 0, idx | 8, idx)


@triton.jit
def _div(a, b):
    """IEEE-rounded ``a / b``: Triton's ``/`` on float32 is an approximate division on the GPU,
    which moves values sitting near a rounding boundary to the other code than torch's.
    Divisions by constants are products with the reciprocal, as in the reference."""
    return tl.math.div_rn(a, b)


@triton.jit
def _quantize_row(x, d, d_ok, data_ptr, scale_ptr, inv_gscale, stride_dd, FMT: tl.constexpr, D: tl.constexpr,
                  BLOCK_D: tl.constexpr, GROUP: tl.constexpr):
    """Store float32 row ``x`` [BLOCK_D] (zeros past D) in format FMT at ``data_ptr`` / ``scale_ptr``;
    one-byte codes ``stride_dd`` apart (1, or the page size where a page keeps its keys
    contiguous per dim: see :func:`ninfer_kernels.kv_quant.allocate_parts`). Returns the
    stored row dequantized (float32), for a kernel that uses it without reading it back."""
    if FMT == 1:  # int8, a scale per GROUP
        g = tl.reshape(tl.abs(x), [BLOCK_D // GROUP, GROUP])
        scale = tl.max(g, 1) * (1.0 / 127.0)
        s = tl.reshape(tl.broadcast_to(scale[:, None], [BLOCK_D // GROUP, GROUP]), [BLOCK_D])
        q = tl.where(s > 0, _div(x, tl.where(s > 0, s, 1.0)), 0.0)
        q = tl.minimum(tl.maximum(round_half_even(q), -127.0), 127.0)
        tl.store(data_ptr + d * stride_dd, q.to(tl.int8), mask=d_ok)
        gi = tl.arange(0, BLOCK_D // GROUP)
        tl.store(scale_ptr + gi, scale, mask=gi < D // GROUP)
        return q * s
    elif FMT == 2:  # fp8, one scale per row; never a NaN code (see kv_quant.quantize_fp8)
        scale = tl.max(tl.abs(x), 0) * (1.0 / 448.0)
        q = _div(x, tl.where(scale > 0, scale, 1.0))
        q = tl.where(q == q, q, 0.0)
        code = round_e4m3(q)
        tl.store(data_ptr + d * stride_dd, code.to(tl.float8e4nv), mask=d_ok)
        tl.store(scale_ptr, scale)
        return code * scale
    else:  # nvfp4: e2m1 pairs, an e4m3 scale per 16
        y = x * inv_gscale
        g = tl.reshape(y, [BLOCK_D // 16, 16])
        block = round_e4m3(tl.max(tl.abs(g), 1) * (1.0 / 6.0))
        bf = tl.reshape(tl.broadcast_to(block[:, None], [BLOCK_D // 16, 16]), [BLOCK_D])
        code = _e2m1_code(tl.where(bf > 0, _div(y, tl.where(bf > 0, bf, 1.0)), 0.0))
        pairs = tl.reshape(code, [BLOCK_D // 2, 2])
        lo, hi = tl.split(pairs)
        byte = (lo | (hi << 4)).to(tl.uint8)
        di = tl.arange(0, BLOCK_D // 2)
        tl.store(data_ptr + di, byte, mask=di < D // 2)
        bi = tl.arange(0, BLOCK_D // 16)
        tl.store(scale_ptr + bi, block.to(tl.float8e4nv), mask=bi < D // 16)
        return e2m1_half(code).to(tl.float32) * bf * (1.0 / inv_gscale)


@triton.jit
def _slot_address(slot, stride_b, stride_s, PAGE: tl.constexpr):
    """Offset of flat cache ``slot`` in a part ``[blocks, PAGE, heads, width]`` with these strides."""
    return (slot // PAGE) * stride_b + (slot % PAGE) * stride_s


@triton.jit
def _write_kernel(k_ptr, v_ptr, slot_ptr, kd_ptr, ks_ptr, vd_ptr, vs_ptr, k_inv_gscale, v_inv_gscale,
                  stride_kt, stride_kh, stride_vt, stride_vh,
                  s_kdb, s_kds, s_kdh, s_kdd, s_ksb, s_kss, s_ksh, s_vdb, s_vds, s_vdh, s_vdd, s_vsb, s_vss, s_vsh,
                  D: tl.constexpr, BLOCK_D: tl.constexpr, KFMT: tl.constexpr, VFMT: tl.constexpr,
                  KGROUP: tl.constexpr, VGROUP: tl.constexpr, PAGE: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:  # padding rows store nothing
        return
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    k = tl.load(k_ptr + t * stride_kt + h * stride_kh + d, mask=d_ok, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=d_ok, other=0.0).to(tl.float32)
    strides = (s_kdb, s_kds, s_kdh, s_kdd, s_ksb, s_kss, s_ksh, s_vdb, s_vds, s_vdh, s_vdd, s_vsb, s_vss, s_vsh)
    _store_kv_head(k, v, d, d_ok, slot, h, kd_ptr, ks_ptr, vd_ptr, vs_ptr, k_inv_gscale, v_inv_gscale, strides,
                   KFMT, VFMT, D, BLOCK_D, KGROUP, VGROUP, PAGE)


@triton.jit
def _store_kv_head(k, v, d, d_ok, slot, h, kd_ptr, ks_ptr, vd_ptr, vs_ptr, k_inv_gscale, v_inv_gscale, strides,
                   KFMT: tl.constexpr, VFMT: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                   KGROUP: tl.constexpr, VGROUP: tl.constexpr, PAGE: tl.constexpr):
    """Quantize float32 rows ``k`` and ``v`` of KV head ``h`` into cache ``slot``; ``strides``
    as :func:`part_strides` gives them, keys' then values'. Returns both rows as stored,
    dequantized."""
    s_kdb, s_kds, s_kdh, s_kdd, s_ksb, s_kss, s_ksh, s_vdb, s_vds, s_vdh, s_vdd, s_vsb, s_vss, s_vsh = strides
    k_stored = _quantize_row(k, d, d_ok, kd_ptr + _slot_address(slot, s_kdb, s_kds, PAGE) + h * s_kdh,
                             ks_ptr + _slot_address(slot, s_ksb, s_kss, PAGE) + h * s_ksh, k_inv_gscale, s_kdd,
                             KFMT, D, BLOCK_D, KGROUP)
    v_stored = _quantize_row(v, d, d_ok, vd_ptr + _slot_address(slot, s_vdb, s_vds, PAGE) + h * s_vdh,
                             vs_ptr + _slot_address(slot, s_vsb, s_vss, PAGE) + h * s_vsh, v_inv_gscale, s_vdd,
                             VFMT, D, BLOCK_D, VGROUP)
    return k_stored, v_stored


def part_strides(parts: Sequence[torch.Tensor]) -> list[int]:
    """Block, slot and head strides of a codec's parts ``(data, scales)``, the data's dim stride
    after its head stride: what the kernels address a part with. Only one-byte codes may
    be strided along the head dims (:func:`ninfer_kernels.kv_quant.allocate_parts`)."""
    data, scales = parts
    if scales.stride(-1) != 1 or (data.stride(-1) != 1 and data.dtype.itemsize != 1):
        raise ValueError("KV parts must be contiguous along their width (one-byte codes excepted)")
    return [*data.stride()[:3], data.stride(3), *scales.stride()[:3]]


def write_kv_quant(k_parts: Sequence[torch.Tensor], v_parts: Sequence[torch.Tensor], k_codec: ref.KVCodec,
                   v_codec: ref.KVCodec, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Same contract as the reference."""
    tokens, heads, head_dim = k.shape
    if tokens == 0:
        return
    if head_dim & (head_dim - 1) or v.shape[-1] != head_dim:
        raise ValueError(f"quantized KV kernels need one power-of-two head dim, got {head_dim} and {v.shape[-1]}")
    _write_kernel[(tokens, heads)](
        k, v, slot_mapping, *k_parts, *v_parts, 1.0 / k_codec.global_scale, 1.0 / v_codec.global_scale,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), *part_strides(k_parts), *part_strides(v_parts),
        D=head_dim, BLOCK_D=max(16, head_dim), KFMT=_format_id(k_codec), VFMT=_format_id(v_codec),
        KGROUP=k_codec.group(head_dim), VGROUP=v_codec.group(head_dim), PAGE=k_parts[0].shape[1],
    )


# -- attention -------------------------------------------------------------------------------------
@triton.jit(do_not_specialize=["num_splits", "stride_ls", "stride_bt"])  # as the decode kernels
def _attend_quant_kernel(
    q_ptr, kd, ks, vd, vs, out_ptr, part_o_ptr, part_lse_ptr, query_start_ptr, seq_lens_ptr, block_tables_ptr,
    qk_scale, num_splits, k_gscale, v_gscale,
    stride_qt, stride_qh, s_kdb, s_kds, s_kdh, s_kdd, s_ksb, s_kss, s_ksh,
    s_vdb, s_vds, s_vdh, s_vdd, s_vsb, s_vss, s_vsh,
    stride_ot, stride_oh, stride_ps, stride_pt, stride_ph, stride_ls, stride_lt, stride_bt,
    GROUP: tl.constexpr, TOKENS: tl.constexpr, PAGE: tl.constexpr, HEAD_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    SPLIT: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
    KFMT: tl.constexpr, VFMT: tl.constexpr, QGROUP: tl.constexpr, HALF: tl.constexpr,
):
    """:func:`ninfer_kernels.triton.paged_attention._attend_kernel` over quantized pages.
    ``HALF``: bf16 queries, products in fp16 (see :data:`HALF_PRODUCTS`)."""
    block = tl.program_id(0)
    seq = tl.program_id(1)
    kv_head = tl.program_id(2) // num_splits
    split = tl.program_id(2) % num_splits
    q_begin = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_begin
    t0 = block * TOKENS
    if t0 >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    head, row_ok, pos, q_rows, lo, hi = _block_rows(q_begin, q_len, t0, seq_len, kv_head, split, num_splits,
                                                    GROUP, TOKENS, BLOCK_M, BLOCK_N, SPLIT)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_D
    if SPLIT:
        if lo >= hi:
            tl.store(part_lse_ptr + split * stride_ls + q_rows * stride_lt + head, float("-inf"), mask=row_ok)
            return
    q = _load_queries(q_ptr, q_rows, head, offs_d, row_ok, d_ok, stride_qt, stride_qh, UPCAST)
    dt = q_ptr.dtype.element_ty
    if HALF:
        q = q.to(tl.float16)
        dt = tl.float16
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    strides = (s_kdb, s_kds, s_kdd, s_ksb, s_kss, s_vdb, s_vds, s_vdd, s_vsb, s_vss)
    kd, ks = kd + kv_head * s_kdh, ks + kv_head * s_ksh
    vd, vs = vd + kv_head * s_vdh, vs + kv_head * s_vsh
    first_pos = seq_len - q_len + t0
    mid = lo + tl.maximum(tl.minimum(hi, first_pos + 1) - lo, 0) // BLOCK_N * BLOCK_N
    acc, m_i, l_i = _attend_pages(acc, m_i, l_i, q, qk_scale, lo, mid, hi, pos, table, kd, ks, vd, vs, strides,
                                  offs_d, d_ok, k_gscale, v_gscale, PAGE, BLOCK_N, KFMT, VFMT, QGROUP, dt, IEEE, UPCAST,
                                  HEAD_D, BLOCK_D)
    _store_rows(acc, m_i, l_i, out_ptr, part_o_ptr, part_lse_ptr, q_rows, head, offs_d, row_ok, d_ok, split,
                stride_ot, stride_oh, stride_ps, stride_pt, stride_ph, stride_ls, stride_lt, SPLIT,
                out_ptr, 0, 0, False)  # (no output gate: quantized formats apply it after)


#: With bf16 queries on the GPU, multiply in fp16 rather than bf16: an fp8 or int8 code
#: converts to fp16 in one instruction on Hopper but to bf16 only through fp32, and at a
#: batch of long contexts that conversion, not the bytes, bounded the kernel (fp8 at 8 x
#: 128k keys ran at half the copy rate while bf16 reached it). fp16 also keeps three more
#: mantissa bits of the dequantized values and the probabilities; stored K/V, queries and
#: probabilities all lie far inside its range (queries and keys are RMS-normed, values are
#: scaled codes, probabilities are at most 1). Accumulation stays float32.
HALF_PRODUCTS = True


def _half_products(q: torch.Tensor) -> bool:
    return HALF_PRODUCTS and q.dtype == torch.bfloat16 and q.device.type == "cuda"


def kv_format_name(k_codec: ref.KVCodec, v_codec: ref.KVCodec) -> str:
    """The formats' name in :mod:`.decode_launch`'s tables: ``fp8``, or ``fp8/nvfp4`` when they differ."""
    return k_codec.name if k_codec.name == v_codec.name else f"{k_codec.name}/{v_codec.name}"


def paged_attention_quant(q: torch.Tensor, k_parts: Sequence[torch.Tensor], v_parts: Sequence[torch.Tensor],
                          k_codec: ref.KVCodec, v_codec: ref.KVCodec, batch: ForwardBatch, scale: float,
                          num_splits: int | None = None, launch: DecodeLaunch | None = None) -> torch.Tensor:
    """Same contract as the reference. ``num_splits`` overrides the key-split heuristic;
    ``launch`` a decode batch's whole shape (else the device's tuned one, if any)."""
    num_tokens, num_heads, head_dim = q.shape
    (kd, ks), (vd, vs) = k_parts, v_parts
    _, page_size, num_kv_heads, _ = ks.shape
    if num_heads % num_kv_heads or page_size & (page_size - 1):
        raise ValueError("query heads must group onto KV heads, and the page size must be a power of two")
    if q.stride(-1) != 1:
        q = q.contiguous()
    group = num_heads // num_kv_heads
    num_seqs = batch.seq_lens.shape[0]
    block_m, tokens, block_n, num_warps, num_stages = _tiles(group, batch.max_query_len, head_dim)
    blocks = max(1, triton.cdiv(batch.max_query_len, tokens))
    if launch is None and num_splits is None and batch.max_query_len == 1:
        launch = tuned_launch(kv_format_name(k_codec, v_codec), head_dim, num_seqs, batch.max_seq_len,
                              MIN_KEYS_PER_SPLIT, q.device)
    if launch is not None:
        num_splits, block_n, num_warps, num_stages = launch.splits, launch.block_n, launch.num_warps, launch.num_stages
    # Without a tuned shape, the prefill kernel's split limits and tiles at decode too: the
    # bf16 decode kernel's (up to 32 splits, 16- or 32-key tiles) measured slower here, 15.8
    # against 15.0 ms a 27B step at 32k context, batch 1 (docs/kv-formats.md).
    splits = num_splits or _num_splits(blocks * num_seqs * num_kv_heads, batch.max_seq_len, q.device)
    out = (torch.zeros if splits == 1 else torch.empty)(num_tokens, num_heads, head_dim, dtype=q.dtype,
                                                        device=q.device)
    if splits == 1:
        part_o = part_lse = out
    else:
        part_o = torch.empty(splits, num_tokens, num_heads, head_dim, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(splits, num_tokens, num_heads, dtype=torch.float32, device=q.device)
    if num_seqs == 0 or num_tokens == 0:
        return out.zero_()
    parts = [kd, ks, vd, vs]
    half = _half_products(q)  # CUDA only, but a test forces it in the interpreter: no UPCAST then
    _attend_quant_kernel[(blocks, num_seqs, num_kv_heads * splits)](
        q, *parts, out, part_o, part_lse, batch.query_start, batch.seq_lens, batch.block_tables,
        scale * math.log2(math.e), splits, k_codec.global_scale, v_codec.global_scale,
        q.stride(0), q.stride(1), *part_strides(k_parts), *part_strides(v_parts),
        out.stride(0), out.stride(1), part_o.stride(0), part_o.stride(1), part_o.stride(2),
        part_lse.stride(0), part_lse.stride(1), batch.block_tables.stride(0),
        GROUP=group, TOKENS=tokens, PAGE=page_size, HEAD_D=head_dim, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)), SPLIT=splits > 1, IEEE=q.dtype == torch.float32,
        UPCAST=q.device.type != "cuda" and q.dtype == torch.bfloat16 and not half,
        KFMT=_format_id(k_codec), VFMT=_format_id(v_codec), QGROUP=ref.int8_group(head_dim),
        HALF=half,
        num_warps=num_warps, num_stages=num_stages,
    )
    if splits > 1:
        _merge_kernel[(num_tokens, num_heads)](
            part_o, part_lse, out, batch.query_start, num_seqs, splits,
            part_o.stride(0), part_o.stride(1), part_o.stride(2), part_lse.stride(0), part_lse.stride(1),
            out.stride(0), out.stride(1), HEAD_DV=head_dim, BLOCK_S=triton.next_power_of_2(splits),
            BLOCK_DV=triton.next_power_of_2(head_dim),
        )
    return out
