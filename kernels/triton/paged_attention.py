"""Paged attention for decode rows and prefill chunks alike, flash-attention style.

One program owns a block of query tokens of one sequence and one KV head, and serves
every query head of that KV head's group from the same K/V tiles: the tile's rows are
(token, head-in-group) pairs, so a decode row of a 4-way GQA model fills four rows
and a prefill block fills ``BLOCK_M`` rows. Keys are gathered page by page through
the block table, so any power-of-two page size works with any key-tile width.

Everything a program needs about its sequence (where its rows start, how long its
context is, which pages it owns) is read from device tensors; host values only size
the grid. That keeps the launch free of host syncs, so a CUDA graph can capture it.

When the grid would leave the GPU mostly idle (decode at small batch over long
contexts), the key range is split across programs (flash-decoding): each writes an
unnormalised partial and its log-sum-exp, and a second kernel merges them.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from ninfer.model.forward_batch import ForwardBatch
from ninfer_kernels.triton import pdl

#: a split covers at least this many keys, so the merge pass stays cheap next to it
MIN_KEYS_PER_SPLIT = 128
#: more splits than this measured slower for decode on an H200 (empty splits still launch,
#: and the merge reads every split)
MAX_SPLITS = 16


@triton.jit
def _mma(a, b, IEEE: tl.constexpr):
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _load_kv_tile(
    start, hi, table, k_base, v_base, stride_kb, stride_ks, stride_vb, stride_vs, offs_d, offs_dv, d_ok, dv_ok,
    PAGE: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
):
    """Keys [BLOCK_D, BLOCK_N] (transposed for the score product) and values
    [BLOCK_N, BLOCK_DV] of positions start..start+BLOCK_N, gathered through the block
    table; a masked tile reads nothing at or past ``hi``."""
    offs_n = start + tl.arange(0, BLOCK_N)
    n_ok = offs_n < hi
    if MASKED:
        page = tl.load(table + offs_n // PAGE, mask=n_ok, other=0).to(tl.int64)
    else:
        page = tl.load(table + offs_n // PAGE).to(tl.int64)
    slot = offs_n % PAGE
    k_ptrs = k_base + page[None, :] * stride_kb + slot[None, :] * stride_ks + offs_d[:, None]
    v_ptrs = v_base + page[:, None] * stride_vb + slot[:, None] * stride_vs + offs_dv[None, :]
    if MASKED:
        k = tl.load(k_ptrs, mask=n_ok[None, :] & d_ok[:, None], other=0.0)
        v = tl.load(v_ptrs, mask=n_ok[:, None] & dv_ok[None, :], other=0.0)
    else:
        k = tl.load(k_ptrs, mask=d_ok[:, None], other=0.0)
        v = tl.load(v_ptrs, mask=dv_ok[None, :], other=0.0)
    return k, v


@triton.jit
def _fold_kv_tile(
    acc, m_i, l_i, q, k, v, qk_scale, p_scale, start, hi, pos,
    BLOCK_N: tl.constexpr, MASKED: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
):
    """Fold one loaded key/value tile into the running softmax state of every row.

    A masked tile also hides keys at or past ``hi`` and keys after a row's position.
    ``qk_scale`` may be a ``[1, BLOCK_N]`` row and ``p_scale`` (1.0 for a plain cache)
    multiplies the probabilities before the value product: a quantized cache with one
    scale per key applies its key and value scales there, on ``BLOCK_N`` numbers instead
    of the whole ``[BLOCK_N, D]`` tile.
    """
    if UPCAST:
        k = k.to(tl.float32)
    s = _mma(q, k, IEEE) * qk_scale  # log2 units: exp2 below
    if MASKED:
        offs_n = start + tl.arange(0, BLOCK_N)
        s = tl.where((offs_n[None, :] < hi) & (offs_n[None, :] <= pos[:, None]), s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # A row with nothing visible yet keeps m = -inf; subtract 0 then, never -inf.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    p = (p * p_scale).to(v.dtype)  # rounded like the K/V operands, as on tensor cores
    if UPCAST:
        p = p.to(tl.float32)
        v = v.to(tl.float32)
    acc = acc * alpha[:, None] + _mma(p, v, IEEE)
    return acc, m_new, l_i


@triton.jit
def _attend_range(
    acc, m_i, l_i, q, qk_scale, lo, mid, hi, pos, table, k_base, v_base,
    stride_kb, stride_ks, stride_vb, stride_vs, offs_d, offs_dv, d_ok, dv_ok,
    PAGE: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
):
    """Fold keys lo..hi into the running softmax state of every row, a tile at a time.

    Tiles below ``mid`` lie wholly below every row's position and inside the context, so
    they skip the bounds and causal masks (most tiles of a long context); the rest are
    masked.
    """
    for start in range(lo, mid, BLOCK_N):
        k, v = _load_kv_tile(start, hi, table, k_base, v_base, stride_kb, stride_ks, stride_vb, stride_vs,
                             offs_d, offs_dv, d_ok, dv_ok, PAGE, BLOCK_N, False)
        acc, m_i, l_i = _fold_kv_tile(acc, m_i, l_i, q, k, v, qk_scale, 1.0, start, hi, pos, BLOCK_N, False, IEEE,
                                      UPCAST)
    for start in range(mid, hi, BLOCK_N):
        k, v = _load_kv_tile(start, hi, table, k_base, v_base, stride_kb, stride_ks, stride_vb, stride_vs,
                             offs_d, offs_dv, d_ok, dv_ok, PAGE, BLOCK_N, True)
        acc, m_i, l_i = _fold_kv_tile(acc, m_i, l_i, q, k, v, qk_scale, 1.0, start, hi, pos, BLOCK_N, True, IEEE,
                                      UPCAST)
    return acc, m_i, l_i


@triton.jit
def _block_rows(q_begin, q_len, t0, seq_len, kv_head, split, num_splits,
                GROUP: tl.constexpr, TOKENS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                SPLIT: tl.constexpr):
    """The rows of a program (token block ``t0..``, every query head of ``kv_head``'s group)
    and the keys they attend to in this split: (head, row_ok, pos, q_rows, lo, hi)."""
    rows = tl.arange(0, BLOCK_M)
    tok = t0 + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_ok = (rows < TOKENS * GROUP) & (tok < q_len)
    pos = seq_len - q_len + tok  # each row sees keys 0..pos
    q_rows = (q_begin + tok).to(tl.int64)
    # Keys this block of rows can see at all, then this split's share of them.
    hi = seq_len - q_len + tl.minimum(t0 + TOKENS, q_len)
    lo = 0
    if SPLIT:
        chunk = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
        lo = split * chunk
        hi = tl.minimum(hi, lo + chunk)
    return head, row_ok, pos, q_rows, lo, hi


# the split count, the partial LSEs' stride (the chunk's rows times the heads: a 63-token and
# a 64-token prompt differ in its divisibility) and the block table's width vary with the
# step; none feeds a vector access, so specialising on them only compiled more variants (the
# 27B's cold start compiled four of this kernel, 8.6 s, session 40). As the quantized kernel
@triton.jit(do_not_specialize=["num_splits", "stride_ls", "stride_bt"])
def _attend_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, part_o_ptr, part_lse_ptr,
    query_start_ptr, seq_lens_ptr, block_tables_ptr,
    qk_scale, num_splits,
    stride_qt, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_ot, stride_oh,
    stride_ps, stride_pt, stride_ph,
    stride_ls, stride_lt,
    stride_bt,
    gate_ptr, stride_gt, stride_gh,
    GROUP: tl.constexpr, TOKENS: tl.constexpr, PAGE: tl.constexpr,
    HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    SPLIT: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr, GATED: tl.constexpr = False,
):
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
    offs_dv = tl.arange(0, BLOCK_DV)
    d_ok = offs_d < HEAD_D
    dv_ok = offs_dv < HEAD_DV
    if SPLIT:
        if lo >= hi:
            # Nothing to see here (the split count is sized for the longest context, so
            # short sequences leave trailing splits empty): mark the partial empty and
            # leave its values unwritten; the merge never reads them.
            tl.store(part_lse_ptr + split * stride_ls + q_rows * stride_lt + head, float("-inf"), mask=row_ok)
            return

    q = _load_queries(q_ptr, q_rows, head, offs_d, row_ok, d_ok, stride_qt, stride_qh, UPCAST)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    k_base = k_ptr + kv_head * stride_kh
    v_base = v_ptr + kv_head * stride_vh
    # Whole tiles that every row sees (keys up to the first row's position) come first.
    first_pos = seq_len - q_len + t0
    mid = lo + tl.maximum(tl.minimum(hi, first_pos + 1) - lo, 0) // BLOCK_N * BLOCK_N
    acc, m_i, l_i = _attend_range(
        acc, m_i, l_i, q, qk_scale, lo, mid, hi, pos, table, k_base, v_base,
        stride_kb, stride_ks, stride_vb, stride_vs, offs_d, offs_dv, d_ok, dv_ok, PAGE, BLOCK_N, IEEE, UPCAST,
    )

    _store_rows(acc, m_i, l_i, out_ptr, part_o_ptr, part_lse_ptr, q_rows, head, offs_dv, row_ok, dv_ok, split,
                stride_ot, stride_oh, stride_ps, stride_pt, stride_ph, stride_ls, stride_lt, SPLIT,
                gate_ptr, stride_gt, stride_gh, GATED)


@triton.jit
def _load_queries(q_ptr, q_rows, head, offs_d, row_ok, d_ok, stride_qt, stride_qh, UPCAST: tl.constexpr):
    """A program's query rows [BLOCK_M, BLOCK_D] (float32 when ``UPCAST``)."""
    q = tl.load(q_ptr + q_rows[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    return q.to(tl.float32) if UPCAST else q


@triton.jit
def gate_tile(o, gate_ptr, row_offs, offs_dv, mask, DT: tl.constexpr):
    """Output rows ``o`` (fp32) times ``sigmoid(gate)`` (the gate's rows at ``row_offs``),
    both rounded to the output dtype first, as the unfused ops
    (:func:`ninfer_kernels.attention.output_gate`) round them."""
    g = tl.load(gate_ptr + row_offs[:, None] + offs_dv[None, :], mask=mask, other=0.0)
    return o.to(DT).to(tl.float32) * tl.sigmoid(g.to(tl.float32)).to(DT).to(tl.float32)


@triton.jit
def _store_rows(acc, m_i, l_i, out_ptr, part_o_ptr, part_lse_ptr, q_rows, head, offs_dv, row_ok, dv_ok, split,
                stride_ot, stride_oh, stride_ps, stride_pt, stride_ph, stride_ls, stride_lt, SPLIT: tl.constexpr,
                gate_ptr, stride_gt, stride_gh, GATED: tl.constexpr):
    """A program's normalised rows: with key splits, the partial and its log-sum-exp for the
    merge (which applies the gate); else the output itself in its dtype, gated with ``GATED``."""
    seen = l_i > 0.0
    o = acc / tl.where(seen, l_i, 1.0)[:, None]
    if SPLIT:
        part = split * stride_ps + q_rows[:, None] * stride_pt + head[:, None] * stride_ph + offs_dv[None, :]
        tl.store(part_o_ptr + part, o, mask=row_ok[:, None] & dv_ok[None, :])
        lse = tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + split * stride_ls + q_rows * stride_lt + head, lse, mask=row_ok)
    else:
        dest = q_rows[:, None] * stride_ot + head[:, None] * stride_oh + offs_dv[None, :]
        mask = row_ok[:, None] & dv_ok[None, :]
        if GATED:
            rows = q_rows.to(tl.int64) * stride_gt + head * stride_gh
            o = gate_tile(o, gate_ptr, rows, offs_dv, mask, out_ptr.dtype.element_ty)
        tl.store(out_ptr + dest, o.to(out_ptr.dtype.element_ty), mask=mask)


# num_seqs, num_splits and stride_ls vary with the step; specialising on them (and BLOCK_S
# on the split count) compiled merge variants inside requests (session 31's compile watch)
@triton.jit(do_not_specialize=["num_seqs", "num_splits", "stride_ls"])
def _merge_kernel(
    part_o_ptr, part_lse_ptr, out_ptr, query_start_ptr, num_seqs, num_splits,
    stride_ps, stride_pt, stride_ph, stride_ls, stride_lt, stride_ot, stride_oh,
    HEAD_DV: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_DV: tl.constexpr, USE_PDL: tl.constexpr = False,
    gate_ptr=None, stride_gt=0, stride_gh=0, GATED: tl.constexpr = False,
):
    """Weight each split's partial by its share of the row's total softmax mass. ``USE_PDL``:
    launched with PDL right behind the kernel that wrote the partials (:mod:`.pdl`).
    ``GATED``: the row is multiplied by ``sigmoid(gate)`` as it is stored."""
    if USE_PDL:
        pdl.wait()
    t = tl.program_id(0)
    h = tl.program_id(1)
    offs_dv = tl.arange(0, BLOCK_DV)
    dv_ok = offs_dv < HEAD_DV
    dest = out_ptr + t.to(tl.int64) * stride_ot + h * stride_oh + offs_dv
    if t >= tl.load(query_start_ptr + num_seqs):
        # Padding row: no sequence owns it.
        tl.store(dest, tl.zeros([BLOCK_DV], dtype=out_ptr.dtype.element_ty), mask=dv_ok)
        return
    offs_s = tl.arange(0, BLOCK_S)
    s_ok = offs_s < num_splits
    lse = tl.load(part_lse_ptr + offs_s * stride_ls + t * stride_lt + h, mask=s_ok, other=float("-inf"))
    # Split 0 always holds key 0, which every row sees, so the max is finite.
    w = tl.exp2(lse - tl.max(lse, 0))
    w = w / tl.sum(w, 0)
    part = part_o_ptr + offs_s[:, None] * stride_ps + t.to(tl.int64) * stride_pt + h * stride_ph + offs_dv[None, :]
    # empty splits left their values unwritten: never read them (0 * garbage may be NaN)
    o = tl.load(part, mask=(s_ok & (lse > float("-inf")))[:, None] & dv_ok[None, :], other=0.0)
    row = tl.sum(o * w[:, None], 0)
    if GATED:
        one = tl.zeros([1], tl.int64) + t.to(tl.int64) * stride_gt + h * stride_gh
        row = tl.sum(gate_tile(row[None, :], gate_ptr, one, offs_dv, dv_ok[None, :], out_ptr.dtype.element_ty), 0)
    tl.store(dest, row.to(out_ptr.dtype.element_ty), mask=dv_ok)


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # interpreter runs: small, so that tests exercise the split path too
    return torch.cuda.get_device_properties(device).multi_processor_count


def _tiles(group: int, max_query_len: int, head_dim: int = 128) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, TOKENS, BLOCK_N, num_warps, num_stages) for this batch's shape.

    Picked from sweeps on an H200 (bf16, page size 16): at head dim 128 (Qwen3-8B,
    scripts/gpu_attention_sweep.py) decode is latency-bound at short contexts, where
    64-key tiles spread over more splits won, and prefill is matrix-bound and 64-row
    tiles balanced the causal triangle best. At head dim 256 (the hybrid models' gated
    attention, scripts/gpu_prefill_attention_sweep.py) prefill wants 128-row tiles over
    8 warps: an 8k prompt took 1.93 instead of 2.86 ms a layer on the 27B shape.
    """
    if max_query_len == 1:
        return max(16, triton.next_power_of_2(group)), 1, 64, 4, 2
    if head_dim > 128:
        block_m = max(128, triton.next_power_of_2(group))
        return block_m, max(1, block_m // group), 64, 8, 2
    block_m = max(64, triton.next_power_of_2(group))
    # a fixed token count per block (rows past a short chunk are masked): tying it to the
    # chunk length would compile a kernel variant per short prompt length on first use
    return block_m, max(1, block_m // group), 64, 4, 2


def _num_splits(
    base_programs: int, max_seq_len: int, device: torch.device, max_splits: int = MAX_SPLITS,
    min_keys: int = MIN_KEYS_PER_SPLIT,
) -> int:
    """Enough key splits for about two programs per multiprocessor, none of them tiny.

    Rounded down to a power of two: uneven last splits measured slower. ``max_seq_len``
    only guides the choice: split ranges are worked out on the device from each
    sequence's own length, so any count is correct for any batch (and a CUDA graph
    captured with one count stays correct when lengths change).
    """
    target = 2 * _num_sms(device)
    if base_programs >= target:
        return 1
    by_keys = math.ceil(max_seq_len / min_keys)
    splits = max(1, min(math.ceil(target / base_programs), by_keys, max_splits))
    return 1 << (splits.bit_length() - 1)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: ForwardBatch,
    scale: float,
    num_splits: int | None = None,
    gate: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of varlen queries [T, H, D] over paged K/V; see the reference.

    ``num_splits`` overrides the key-split heuristic (tests use it to cover both paths).
    ``gate`` [T, H, Dv] (any row strides): the output is multiplied by ``sigmoid(gate)``
    as it is stored, instead of by two more launches after.
    """
    num_tokens, num_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = k_cache.shape
    head_dim_v = v_cache.shape[-1]
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if page_size & (page_size - 1):
        raise ValueError(f"page size must be a power of two, got {page_size}")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("K/V caches must be contiguous in their last dimension")
    if q.stride(-1) != 1:
        q = q.contiguous()
    group = num_heads // num_kv_heads
    num_seqs = batch.seq_lens.shape[0]
    block_m, tokens, block_n, num_warps, num_stages = _tiles(group, batch.max_query_len, head_dim)
    blocks = max(1, triton.cdiv(batch.max_query_len, tokens))
    splits = num_splits or _num_splits(blocks * num_seqs * num_kv_heads, batch.max_seq_len, q.device)

    if splits == 1:
        out = torch.zeros(num_tokens, num_heads, head_dim_v, dtype=q.dtype, device=q.device)
        part_o = part_lse = out  # unused by the kernel when SPLIT is off
    else:
        out = torch.empty(num_tokens, num_heads, head_dim_v, dtype=q.dtype, device=q.device)
        part_o = torch.empty(splits, num_tokens, num_heads, head_dim_v, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(splits, num_tokens, num_heads, dtype=torch.float32, device=q.device)
    if num_seqs == 0 or num_tokens == 0:
        return out.zero_()
    if gate is not None and gate.stride(-1) != 1:
        gate = gate.contiguous()
    gated = gate is not None
    gate_args = (gate, gate.stride(0), gate.stride(1)) if gated else (None, 0, 0)

    _attend_kernel[(blocks, num_seqs, num_kv_heads * splits)](
        q, k_cache, v_cache, out, part_o, part_lse,
        batch.query_start, batch.seq_lens, batch.block_tables,
        scale * math.log2(math.e), splits,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        out.stride(0), out.stride(1),
        part_o.stride(0), part_o.stride(1), part_o.stride(2),
        part_lse.stride(0), part_lse.stride(1),
        batch.block_tables.stride(0), *gate_args,
        GROUP=group, TOKENS=tokens, PAGE=page_size, HEAD_D=head_dim, HEAD_DV=head_dim_v,
        BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)), BLOCK_DV=max(16, triton.next_power_of_2(head_dim_v)),
        SPLIT=splits > 1, IEEE=q.dtype == torch.float32,
        # Triton's interpreter (CPU tensors) multiplies bf16 dot operands as raw bits.
        UPCAST=q.device.type != "cuda" and q.dtype == torch.bfloat16, GATED=gated and splits == 1,
        num_warps=num_warps, num_stages=num_stages,
    )
    if splits > 1:
        _merge_kernel[(num_tokens, num_heads)](
            part_o, part_lse, out, batch.query_start, num_seqs, splits,
            part_o.stride(0), part_o.stride(1), part_o.stride(2),
            part_lse.stride(0), part_lse.stride(1), out.stride(0), out.stride(1),
            HEAD_DV=head_dim_v, BLOCK_S=max(MAX_SPLITS, triton.next_power_of_2(splits)),  # one variant
            BLOCK_DV=triton.next_power_of_2(head_dim_v), gate_ptr=gate_args[0], stride_gt=gate_args[1],
            stride_gh=gate_args[2], GATED=gated,
        )
    return out
