"""Decode over a quantized KV cache in one launch: :mod:`.decode_attention`'s kernel for
the formats of :mod:`ninfer_kernels.kv_quant`.

Built from the separate kernels, a quantized decode layer is four launches: q/k norm and
RoPE, the quantized write, attention (:mod:`.kv_quant`) and the merge of its key splits.
At batch 1 every launch is latency, and at 8 x 128k on the 27B shape the launches around
attention cost 2.5% of the layer (docs/kv-formats.md). Here, as in the bf16 decode kernel,
each (sequence, KV head, key split) program

1. normalises and rotates its group's query heads itself;
2. attends over the cached keys of its range with :mod:`.kv_quant`'s tile code (codes
   dequantized in registers, fp16 products for bf16 queries on CUDA);
3. if its range holds the new position, normalises and rotates the new key, quantizes
   it and the value into their page, and folds the stored (dequantized) key and value
   in from registers: nothing reads that slot back in this launch;
4. with several splits, stores its partial, and the last program of a (sequence, KV
   head) to arrive merges them (:func:`.decode_merge._merge_partials`); past
   :data:`MERGE_INSIDE_SPLITS` splits a second launch merges instead.

With PDL the launch overlaps the end of the projection before it (:mod:`.pdl`).
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
import triton
import triton.language as tl

from ninfer.model.forward_batch import ForwardBatch
from ninfer_kernels import kv_quant as ref
from ninfer_kernels.attention import output_gate
from ninfer_kernels.triton import pdl
from ninfer_kernels.triton.counters import counter_buffer
from ninfer_kernels.triton.decode_attention import _finish_rows, _split_keys, gate_args, merge_splits
from ninfer_kernels.triton.decode_rows import _fold_new_key, _norm_rope_factors, _norm_rope_rows
from ninfer_kernels.triton.decode_launch import DecodeLaunch, tuned_launch
from ninfer_kernels.triton.kv_quant import _format_id, _half_products, _store_kv_head, kv_format_name, part_strides
from ninfer_kernels.triton.kv_quant_tiles import _attend_pages
from ninfer_kernels.triton.paged_attention import MIN_KEYS_PER_SPLIT, _merge_kernel, _num_splits, _tiles
from ninfer_kernels.triton.qk_norm_rope import check_rotary_dim

#: with more key splits than this, a second kernel merges them, a program per query head:
#: at 1 x 128k keys on the 27B shape (64 splits) the last split's merge of all of them made
#: the launch 24% slower than the four-launch decode (143 against 115 us a layer)
MERGE_INSIDE_SPLITS = 16


# one variant for every split count, block-table width and partial-LSE stride, as the bf16
# decode kernel (kernels/triton/decode_attention.py says why)
@triton.jit(do_not_specialize=["num_kv_heads", "num_splits", "stride_ls", "stride_bt"])
def _decode_quant_kernel(
    q_ptr, k_ptr, v_ptr, qw_ptr, kw_ptr, pos_ptr, cos_sin_ptr,
    kd, ks, vd, vs, slot_ptr, seq_lens_ptr, block_tables_ptr,
    out_ptr, part_o_ptr, part_lse_ptr, count_ptr, gate_ptr,
    qk_scale, eps, num_kv_heads, num_splits, k_gscale, v_gscale, k_inv_gscale, v_inv_gscale,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_cs,
    s_kdb, s_kds, s_kdh, s_kdd, s_ksb, s_kss, s_ksh, s_vdb, s_vds, s_vdh, s_vdd, s_vsb, s_vss, s_vsh,
    stride_ot, stride_oh, stride_ps, stride_pt, stride_ph, stride_ls, stride_lt, stride_bt, stride_gt, stride_gh,
    GROUP: tl.constexpr, PAGE: tl.constexpr, HEAD_D: tl.constexpr, HALF: tl.constexpr, ROT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_S: tl.constexpr, MERGE_S: tl.constexpr,
    SPLIT: tl.constexpr, MERGE: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr, F16: tl.constexpr,
    KFMT: tl.constexpr, VFMT: tl.constexpr, KGROUP: tl.constexpr, VGROUP: tl.constexpr, QGROUP: tl.constexpr,
    GATED: tl.constexpr, USE_PDL: tl.constexpr,
):
    """``F16``: bf16 queries, products in fp16 (:data:`.kv_quant.HALF_PRODUCTS`). ``MERGE``:
    the last split merges; else every split stores its partial (empty ones a log-sum-exp of
    -inf) for :func:`.paged_attention._merge_kernel`. ``GATED``: the output gate is applied
    where this kernel writes the output (not when the second kernel merges)."""
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    # Nothing read before the wait is what the projection before writes.
    seq_len = tl.load(seq_lens_ptr + seq)
    cs_row = cos_sin_ptr + tl.load(pos_ptr + seq).to(tl.int64) * stride_cs
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_D
    lo, hi, new, cached_hi, active = _split_keys(seq_len, split, num_splits, BLOCK_N)
    table = block_tables_ptr + seq * stride_bt
    strides = (s_kdb, s_kds, s_kdd, s_ksb, s_kss, s_vdb, s_vds, s_vdd, s_vsb, s_vss)
    kd_h, ks_h = kd + kv_head * s_kdh, ks + kv_head * s_ksh
    vd_h, vs_h = vd + kv_head * s_vdh, vs + kv_head * s_vsh
    qw, qwp, cos, signed_sin = _norm_rope_factors(qw_ptr, cs_row, HEAD_D, HALF, ROT, BLOCK_D)
    kw, kwp, _, _ = _norm_rope_factors(kw_ptr, cs_row, HEAD_D, HALF, ROT, BLOCK_D)
    slot = tl.load(slot_ptr + seq).to(tl.int64)
    if USE_PDL:
        pdl.wait()
    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < GROUP
    head = kv_head * GROUP + rows
    if split >= active:
        if SPLIT and not MERGE:
            tl.store(part_lse_ptr + split * stride_ls + seq * stride_lt + head, float("-inf"), mask=row_ok)
        return

    q = _norm_rope_rows(q_ptr, seq * stride_qt + head.to(tl.int64) * stride_qh, row_ok, qw, qwp, cos, signed_sin, eps,
                        HEAD_D, HALF, ROT, BLOCK_D)
    dt = q_ptr.dtype.element_ty
    if F16:
        q = q.to(tl.float16)
        dt = tl.float16
    q_dot = q.to(tl.float32) if UPCAST else q
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    pos = tl.zeros([BLOCK_M], dtype=tl.int32) + new
    mid = lo + tl.maximum(cached_hi - lo, 0) // BLOCK_N * BLOCK_N
    acc, m_i, l_i = _attend_pages(acc, m_i, l_i, q_dot, qk_scale, lo, mid, cached_hi, pos, table, kd_h, ks_h, vd_h,
                                  vs_h, strides, offs_d, d_ok, k_gscale, v_gscale, PAGE, BLOCK_N, KFMT, VFMT, QGROUP,
                                  dt, IEEE, UPCAST, HEAD_D, BLOCK_D)

    if (lo <= new) & (new < hi):
        one = tl.arange(0, 2) < 1  # a one-row tile (two rows, the second masked off)
        k_new = _norm_rope_rows(k_ptr, seq * stride_kt + kv_head * stride_kh + tl.zeros([2], tl.int64), one,
                                kw, kwp, cos, signed_sin, eps, HEAD_D, HALF, ROT, BLOCK_D)
        # rounded to the activation dtype first, as the unfused norm hands it to the write
        k_new = tl.sum(tl.where(one[:, None], k_new.to(k_ptr.dtype.element_ty).to(tl.float32), 0.0), 0)
        v_new = tl.load(v_ptr + seq * stride_vt + kv_head * stride_vh + offs_d, mask=d_ok, other=0.0).to(tl.float32)
        if slot >= 0:  # padding rows (slot -1) store nothing
            all_strides = (s_kdb, s_kds, s_kdh, s_kdd, s_ksb, s_kss, s_ksh, s_vdb, s_vds, s_vdh, s_vdd, s_vsb, s_vss,
                           s_vsh)
            k_new, v_new = _store_kv_head(k_new, v_new, offs_d, d_ok, slot, kv_head, kd, ks, vd, vs, k_inv_gscale,
                                          v_inv_gscale, all_strides, KFMT, VFMT, HEAD_D, BLOCK_D, KGROUP, VGROUP,
                                          PAGE)
        acc, m_i, l_i = _fold_new_key(acc, m_i, l_i, q, k_new, v_new, qk_scale, row_ok, dt)
    _finish_rows(acc, m_i, l_i, out_ptr, part_o_ptr, part_lse_ptr, count_ptr, gate_ptr, seq, seq + 0 * rows, kv_head,
                 split, active, num_kv_heads, head, row_ok, offs_d, d_ok, stride_ot, stride_oh, stride_ps, stride_pt,
                 stride_ph, stride_ls, stride_lt, stride_gt, stride_gh, GROUP, HEAD_D, BLOCK_G, BLOCK_S, MERGE_S,
                 BLOCK_D, SPLIT, MERGE, GATED)


def decode_attention_quant(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, norm_rope,
                           k_parts: Sequence[torch.Tensor], v_parts: Sequence[torch.Tensor], k_codec: ref.KVCodec,
                           v_codec: ref.KVCodec, batch: ForwardBatch, scale: float, gate: torch.Tensor | None = None,
                           num_splits: int | None = None, launch: DecodeLaunch | None = None) -> torch.Tensor:
    """Same contract as the reference. ``num_splits`` overrides the key-split heuristic;
    ``launch`` the whole shape (else the device's tuned one, if any)."""
    n = norm_rope
    num_seqs, num_heads, head_dim = q.shape
    (kd, ks), (vd, vs) = k_parts, v_parts
    _, page_size, num_kv_heads, _ = ks.shape
    if batch.max_query_len != 1 or batch.seq_lens.shape[0] != num_seqs:
        raise ValueError("decode_attention_quant takes decode batches only (one new token per sequence)")
    if num_heads % num_kv_heads or k.shape[1] != num_kv_heads or page_size & (page_size - 1):
        raise ValueError("query heads must group onto KV heads, and the page size must be a power of two")
    if head_dim & (head_dim - 1) or head_dim < 16 or v.shape[-1] != head_dim:
        raise ValueError(f"quantized KV kernels need one power-of-two head dim >= 16, got {head_dim} and "
                         f"{v.shape[-1]}")
    check_rotary_dim(n.rotary_dim, head_dim, n.cos_sin)
    if any(t.stride(-1) != 1 for t in (q, k, v, n.cos_sin)):
        raise ValueError("q, k, v and the cos/sin table must be contiguous in their last dimension")
    out = torch.empty(num_seqs, num_heads, head_dim, dtype=q.dtype, device=q.device)
    gate_arg, gate_strides = gate_args(gate, out)
    if num_seqs == 0:
        return out
    group = num_heads // num_kv_heads
    block_m, _, block_n, num_warps, num_stages = _tiles(group, 1, head_dim)
    if launch is None and num_splits is None:
        launch = tuned_launch(kv_format_name(k_codec, v_codec), head_dim, num_seqs, batch.max_seq_len,
                              MIN_KEYS_PER_SPLIT, q.device)
    if launch is not None:
        num_splits, block_n, num_warps, num_stages = launch.splits, launch.block_n, launch.num_warps, launch.num_stages
    splits = num_splits or _num_splits(num_seqs * num_kv_heads, batch.max_seq_len, q.device)
    if splits > 1:
        part_o = torch.empty(splits, num_seqs, num_heads, head_dim, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(splits, num_seqs, num_heads, dtype=torch.float32, device=q.device)
    else:
        part_o = part_lse = out  # unused when SPLIT is off
    merge_inside = splits <= MERGE_INSIDE_SPLITS
    counters = counter_buffer("decode_attention_quant", q.device, num_seqs * num_kv_heads, minimum=1 << 16)
    use_pdl = pdl.enabled(q.device)
    half = _half_products(q)
    _decode_quant_kernel[(num_seqs, num_kv_heads, splits)](
        q, k, v, n.q_weight.contiguous(), n.k_weight.contiguous(), n.positions, n.cos_sin,
        kd, ks, vd, vs, batch.slot_mapping, batch.seq_lens, batch.block_tables,
        out, part_o, part_lse, counters, gate_arg,
        scale * math.log2(math.e), n.eps, num_kv_heads, splits, k_codec.global_scale, v_codec.global_scale,
        1.0 / k_codec.global_scale, 1.0 / v_codec.global_scale,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), n.cos_sin.stride(0),
        *part_strides(k_parts), *part_strides(v_parts),
        out.stride(0), out.stride(1), part_o.stride(0), part_o.stride(1), part_o.stride(2),
        part_lse.stride(0), part_lse.stride(1), batch.block_tables.stride(0), *gate_strides,
        GROUP=group, PAGE=page_size, HEAD_D=head_dim, HALF=n.rotary_dim // 2, ROT=n.rotary_dim,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=head_dim,
        BLOCK_G=triton.next_power_of_2(group), BLOCK_S=triton.next_power_of_2(splits),
        MERGE_S=min(merge_splits(), triton.next_power_of_2(splits)),
        SPLIT=splits > 1, MERGE=merge_inside, IEEE=q.dtype == torch.float32,
        UPCAST=q.device.type != "cuda" and q.dtype == torch.bfloat16 and not half, F16=half,
        KFMT=_format_id(k_codec), VFMT=_format_id(v_codec), KGROUP=k_codec.group(head_dim),
        VGROUP=v_codec.group(head_dim), QGROUP=ref.int8_group(head_dim), USE_PDL=use_pdl,
        GATED=gate is not None and merge_inside,  # else applied after the second kernel below
        num_warps=num_warps, num_stages=num_stages, **pdl.launch_options(use_pdl),
    )
    if splits > 1 and not merge_inside:
        _merge_kernel[(num_seqs, num_heads)](
            part_o, part_lse, out, batch.query_start, num_seqs, splits,
            part_o.stride(0), part_o.stride(1), part_o.stride(2), part_lse.stride(0), part_lse.stride(1),
            out.stride(0), out.stride(1), HEAD_DV=head_dim, BLOCK_S=triton.next_power_of_2(splits),
            BLOCK_DV=head_dim, USE_PDL=use_pdl, **pdl.launch_options(use_pdl),
        )
        return output_gate(out, gate)
    return out
