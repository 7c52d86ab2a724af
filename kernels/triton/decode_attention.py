"""Decode attention in one Triton launch; see :mod:`ninfer_kernels.decode_attention`.

The grid is (sequence, KV head, key split). Each program:

1. normalises and rotates the query heads of its KV head's group itself: a few hundred
   multiply-adds, far cheaper than a separate launch at batch 1;
2. attends over the cached keys of its range with the same tile code as
   :mod:`.paged_attention`;
3. if its range holds the new position, normalises and rotates the new key, stores it
   and the value into the cache page, and folds that key in from registers (nothing in
   this launch reads the slot back, so no load waits for the store).

With PDL (:mod:`.pdl`) the launch overlaps the end of the projection before it.

With several splits, each program whose range holds keys stores a partial output and
its log-sum-exp, then bumps a per-(sequence, KV head) counter; the program that arrives
last merges the partials and zeroes the counter for the next call (splits past a short
sequence's end exit at once). That replaces the second kernel a split needs otherwise.
Counters come from :mod:`.counters`, allocated before any CUDA graph captures the kernel
(the warm-up passes run it first).

With ``NINFER_FUSED_VERIFY=1``, speculative verify rows (``k + 1`` tokens a sequence) and
the MTP head's extend take the same launch (``ROWS`` tokens a sequence,
:func:`ninfer_kernels.decode_attention.fits_rows`):
a program's rows are then (token, head-in-group) pairs, each query turned by its own
position; the cached keys before the first new token are shared by every row, and the
split holding the last new key stores all ``ROWS`` of them and folds each in from
registers into the rows of its token and the later ones. Every row's position, rotary
factors and the new keys' slots are gathered before the wait, and the queries and the
new keys are each normalised and turned as one tile after it. The unfused path takes four
launches a layer for these rows (norm and RoPE, the KV write, attention, its merge), and
it is the default: in session 35's rounds it was faster on both shapes measured (see
:data:`ninfer_kernels.decode_attention.FUSED_VERIFY`), against this kernel's first form,
which read a position and then its rotary row per token after the wait (81 loads at
``gpu-deep``'s shape; 39 now).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ninfer.model.forward_batch import ForwardBatch
from ninfer_kernels.decode_attention import MAX_GROUP_ROWS, MAX_ROWS, fits_rows
from ninfer_kernels.triton import pdl
from ninfer_kernels.triton.counters import counter_buffer
from ninfer_kernels.triton.decode_launch import tuned_launch
from ninfer_kernels.triton.decode_merge import _gate_rows, _merge_partials
from ninfer_kernels.triton.tuned_tables import forced
from ninfer_kernels.triton.decode_rows import (
    _fold_new_key, _new_keys_tile, _norm_rope_factors, _norm_rope_rows, _norm_rope_tile, _tile_factors,
)
from ninfer_kernels.triton.paged_attention import _attend_range, _fold_kv_tile, _load_kv_tile, _num_splits
from ninfer_kernels.triton.qk_norm_rope import check_rotary_dim

#: launch shape per head dim: (warps, stages, key tile, the key tile of launches with at
#: least ``small tile splits`` splits, small tile splits), from the decode sweeps on an H200
#: (scripts/gpu_decode_attention_sweep.py, then scripts/gpu_decode_insitu.py inside whole
#: replayed steps). Batch-1 launches (many splits) are bound by memory latency, and a
#: small tile spreads short contexts over more programs (with fewer splits, long contexts
#: ran faster on 64 keys). Head dim 256 (the hybrids' gated attention, 6-8 query heads per
#: KV head) needs twice the warps for its tiles: at batch 1 and 768 keys, 4 warps and
#: 16-key tiles took 11.5 us a layer (35B-A3B) and 10.9 (27B) against 19.7 and 16.0 with
#: the head-dim-128 shape; with 8 splits (the 27B at batch 8) 32-key tiles were faster.
#: A head dim without an entry takes the nearest smaller one. A device table of
#: :mod:`.decode_launch` (tuned at long contexts) overrides these and the split limits.
LAUNCH_SHAPES = {128: (2, 1, 64, 32, 32), 256: (4, 1, 32, 16, 16)}
#: at most this many key splits, of at least this many keys each (decode's own limits: more
#: and shorter splits than the prefill kernel's, since at batch 1 memory latency, not work,
#: bounds each program)
MAX_SPLITS, MIN_KEYS_PER_SPLIT = 32, 64
#: up to this many keys a split, a sequence's keys go to at most ``MERGE_S`` splits, so the
#: last of them merges the partials in one pass (:func:`.decode_merge._merge_online`,
#: which also merges longer contexts a round trip a pass). A graph is captured with the
#: splits its max context wants; at short contexts the rest stay empty. Inside whole
#: batch-1 steps at 512-767 keys (H100, session 45, two calls each against 32 splits
#: merged as the log-sum-exps then two passes): the 30B-A3B (head dim 128) 285.1 / 285.3
#: tok/s against 272.4 / 272.0 (+4.8%), the 35B-A3B (head dim 256) 331.0 / 332.7 against
#: 327.9 / 329.4 (+1.0%). There 16 splits in all ran faster on the 35B-A3B (335.9 /
#: 336.4) and slower on the 30B-A3B (279.2 / 279.4), but a graph's split count follows
#: its max context (64 at batch 1 past 16k keys, from the H200 table), so only this rule
#: fits the splits to the keys a step has. ``NINFER_DECODE_ONE_PASS_KEYS=1`` turns it
#: off (read per call, for A/B runs). Speculative verify rows never take it. Since those
#: runs, a one-pass merge reads its partials all at once instead of through the loop
#: (fewer spills, :mod:`.decode_merge`; untimed).
ONE_PASS_KEYS = 128
#: partials the merging program reads per pass. Sixteen hold 256 floats a thread at batch
#: 1 on both MoE shapes (8 query heads a KV head; head dim 128 on 2 warps, 256 on 4):
#: ptxas (sm_90, triton 3.6) spills 408 and 384 bytes there, eight spill nothing, yet
#: eight were no faster in whole steps (H100, session 45: 326.0 against 327.9 tok/s on
#: the 35B-A3B, 272.4 both on the 30B-A3B; with 16 splits 333.3 / 274.0 against 335.9 /
#: 279.2). ``NINFER_DECODE_MERGE_SPLITS`` overrides it (read per call, for A/B runs).
MERGE_SPLITS = 16


def merge_splits() -> int:
    """Partials a merge pass reads: :data:`MERGE_SPLITS`, or its switch."""
    return forced("NINFER_DECODE_MERGE_SPLITS") or MERGE_SPLITS


# the split count varies with the batch and the longest context: one variant for all of them
# (a count that is a multiple of 16 compiled its own while serving, 2-3 s, session 36). So do
# the block table's width and the partial LSEs' stride (the step's rows times the heads) in
# steps that run outside the graphs (a speculating engine's verify rows beside a prefill
# chunk): one of their combinations compiled while serving, 2.1 s (session 39). Neither
# feeds a vector access: page ids and LSEs are read and written a few scalars at a time
@triton.jit(do_not_specialize=["num_kv_heads", "num_splits", "stride_ls", "stride_bt"])
def _decode_kernel(
    q_ptr, k_ptr, v_ptr, qw_ptr, kw_ptr, pos_ptr, cos_sin_ptr,
    k_cache_ptr, v_cache_ptr, slot_ptr, seq_lens_ptr, block_tables_ptr,
    out_ptr, part_o_ptr, part_lse_ptr, count_ptr, gate_ptr,
    qk_scale, eps, num_kv_heads, num_splits,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_cs,
    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
    stride_ot, stride_oh, stride_ps, stride_pt, stride_ph, stride_ls, stride_lt, stride_bt, stride_gt, stride_gh,
    GROUP: tl.constexpr, PAGE: tl.constexpr, HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr,
    HALF: tl.constexpr, ROT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_S: tl.constexpr, MERGE_S: tl.constexpr,
    SPLIT: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr, GATED: tl.constexpr, USE_PDL: tl.constexpr,
    ROWS: tl.constexpr = 1, KROWS: tl.constexpr = 2, ONE_PASS_KEYS: tl.constexpr = 1,
):
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    # Batch metadata and the cached pages are never what the kernel just before wrote
    # (that is the projection), so they are read before waiting on it.
    seq_len = tl.load(seq_lens_ptr + seq)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    d_ok = offs_d < HEAD_D
    dv_ok = offs_dv < HEAD_DV
    lo, hi, new, cached_hi, active = _split_keys(seq_len, split, num_splits, BLOCK_N, ROWS, ONE_PASS_KEYS, MERGE_S)
    table = block_tables_ptr + seq * stride_bt
    k_base = k_cache_ptr + kv_head * stride_kch
    v_base = v_cache_ptr + kv_head * stride_vch
    # The first tile's keys and values are fetched before the wait: at short contexts
    # that is all a split reads, and its memory latency overlaps the projection's end.
    k0, v0 = _load_kv_tile(lo, cached_hi, table, k_base, v_base, stride_kcb, stride_kcs, stride_vcb, stride_vcs,
                           offs_d, offs_dv, d_ok, dv_ok, PAGE, BLOCK_N, True)
    # rows are (token, head-in-group) pairs, token-major: one token a sequence at decode,
    # ROWS of them for speculative verify rows
    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < GROUP * ROWS
    t = rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    tok = seq * ROWS + t
    # So are the norm weights, cos/sin and the KV slots: otherwise each is a memory round
    # trip after the wait (the weights and the rotary table are rarely still in L2).
    if ROWS == 1:
        cs_row = cos_sin_ptr + tl.load(pos_ptr + seq).to(tl.int64) * stride_cs
        qw, qwp, cos, signed_sin = _norm_rope_factors(qw_ptr, cs_row, HEAD_D, HALF, ROT, BLOCK_D)
        kw, kwp, _, _ = _norm_rope_factors(kw_ptr, cs_row, HEAD_D, HALF, ROT, BLOCK_D)
        slot = tl.load(slot_ptr + seq).to(tl.int64)
    else:  # every row's own position: its rotary factors, and the new keys' (KROWS tile rows)
        qw, qwp, q_cos, q_sin = _tile_factors(qw_ptr, pos_ptr, cos_sin_ptr, tok, row_ok, stride_cs, HEAD_D, HALF,
                                              ROT, BLOCK_D)
        new_tok = seq * ROWS + tl.arange(0, KROWS)
        new_ok = tl.arange(0, KROWS) < ROWS
        kw, kwp, k_cos, k_sin = _tile_factors(kw_ptr, pos_ptr, cos_sin_ptr, new_tok, new_ok, stride_cs, HEAD_D,
                                              HALF, ROT, BLOCK_D)
        new_slots = tl.load(slot_ptr + new_tok, mask=new_ok, other=-1).to(tl.int64)
    if USE_PDL:
        pdl.wait()
    if split >= active:
        return

    if ROWS == 1:
        q = _norm_rope_rows(q_ptr, seq * stride_qt + head.to(tl.int64) * stride_qh, row_ok, qw, qwp, cos, signed_sin,
                            eps, HEAD_D, HALF, ROT, BLOCK_D)
        # The new key and value, in every program: a 256-byte read is cheaper than waiting
        # to learn which program needs them.
        one = tl.arange(0, 2) < 1  # a one-row tile (two rows, the second masked off)
        k_new = _norm_rope_rows(k_ptr, seq * stride_kt + kv_head * stride_kh + tl.zeros([2], tl.int64), one,
                                kw, kwp, cos, signed_sin, eps, HEAD_D, HALF, ROT, BLOCK_D)
        k_new = tl.sum(tl.where(one[:, None], k_new.to(k_cache_ptr.dtype.element_ty).to(tl.float32), 0.0), 0)
        v_new = tl.load(v_ptr + seq * stride_vt + kv_head * stride_vh + offs_dv, mask=dv_ok, other=0.0)
        v_new = v_new.to(v_cache_ptr.dtype.element_ty)
    else:
        q = _norm_rope_tile(q_ptr, tok * stride_qt + head.to(tl.int64) * stride_qh, row_ok, qw, qwp, q_cos, q_sin,
                            eps, HEAD_D, HALF, ROT, BLOCK_D)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    pos = seq_len - ROWS + t  # each row sees the keys up to its own token
    q_dot = q.to(tl.float32) if UPCAST else q
    acc, m_i, l_i = _fold_kv_tile(acc, m_i, l_i, q_dot, k0, v0, qk_scale, 1.0, lo, cached_hi, pos,
                                  BLOCK_N, True, IEEE, UPCAST)
    start = lo + BLOCK_N
    mid = start + tl.maximum(cached_hi - start, 0) // BLOCK_N * BLOCK_N
    acc, m_i, l_i = _attend_range(
        acc, m_i, l_i, q_dot, qk_scale, start, mid, cached_hi, pos, table, k_base, v_base,
        stride_kcb, stride_kcs, stride_vcb, stride_vcs, offs_d, offs_dv, d_ok, dv_ok, PAGE, BLOCK_N, IEEE, UPCAST,
    )
    holds_new = (lo <= new) & (new < hi)
    if holds_new:
        if ROWS == 1:
            if slot >= 0:  # padding rows (slot -1) store nothing
                page, offset = slot // PAGE, slot % PAGE
                tl.store(k_cache_ptr + page * stride_kcb + offset * stride_kcs + kv_head * stride_kch + offs_d,
                         k_new.to(k_cache_ptr.dtype.element_ty), mask=d_ok)
                tl.store(v_cache_ptr + page * stride_vcb + offset * stride_vcs + kv_head * stride_vch + offs_dv,
                         v_new, mask=dv_ok)
            acc, m_i, l_i = _fold_new_key(acc, m_i, l_i, q, k_new, v_new, qk_scale, row_ok,
                                          v_cache_ptr.dtype.element_ty)
        else:
            acc, m_i, l_i = _new_keys_tile(
                acc, m_i, l_i, q, t, k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, new_tok, new_ok, new_slots, kw, kwp,
                k_cos, k_sin, kv_head, qk_scale, eps, stride_kt, stride_kh, stride_vt, stride_vh,
                stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch, offs_d, offs_dv, d_ok, dv_ok,
                ROWS, KROWS, PAGE, HEAD_D, HALF, ROT, BLOCK_D)
    _finish_rows(acc, m_i, l_i, out_ptr, part_o_ptr, part_lse_ptr, count_ptr, gate_ptr, seq, tok, kv_head, split,
                 active, num_kv_heads, head, row_ok, offs_dv, dv_ok, stride_ot, stride_oh, stride_ps, stride_pt,
                 stride_ph, stride_ls, stride_lt, stride_gt, stride_gh, GROUP, HEAD_DV, BLOCK_G, BLOCK_S, MERGE_S,
                 BLOCK_DV, SPLIT, True, GATED, ROWS, ONE_PASS_KEYS > 1)


@triton.jit
def _split_keys(seq_len, split, num_splits, BLOCK_N: tl.constexpr, ROWS: tl.constexpr = 1,
                ONE_PASS_KEYS: tl.constexpr = 1, MERGE_S: tl.constexpr = 1):
    """A decode program's share of its sequence's keys: ``lo..hi`` (the same ranges as the
    prefill/decode kernel's; past 1 ``ONE_PASS_KEYS``, a sequence whose keys fit ``MERGE_S``
    splits of that many keys fills no more than ``MERGE_S``), the last new key's position
    ``new``, ``cached_hi`` (its share without the ``ROWS`` new keys, which are never read
    back from the page: the split holding the last folds them all in from registers, so no
    load waits for their store), and how many splits hold keys at all (``active``: the
    rest store nothing and the merge does not count them)."""
    chunk = tl.cdiv(seq_len, num_splits)
    if ONE_PASS_KEYS > 1:
        chunk = tl.maximum(chunk, tl.minimum(tl.cdiv(seq_len, MERGE_S), ONE_PASS_KEYS))
    chunk = tl.cdiv(chunk, BLOCK_N) * BLOCK_N
    lo = split * chunk
    hi = tl.minimum(seq_len, lo + chunk)
    new = seq_len - 1
    return lo, hi, new, tl.minimum(hi, seq_len - ROWS), tl.cdiv(seq_len, chunk)


@triton.jit
def _finish_rows(acc, m_i, l_i, out_ptr, part_o_ptr, part_lse_ptr, count_ptr, gate_ptr, seq, tok, kv_head, split,
                 active, num_kv_heads, head, row_ok, offs_dv, dv_ok, stride_ot, stride_oh, stride_ps, stride_pt,
                 stride_ph, stride_ls, stride_lt, stride_gt, stride_gh, GROUP: tl.constexpr, HEAD_DV: tl.constexpr,
                 BLOCK_G: tl.constexpr, BLOCK_S: tl.constexpr, MERGE_S: tl.constexpr, BLOCK_DV: tl.constexpr,
                 SPLIT: tl.constexpr, MERGE: tl.constexpr, GATED: tl.constexpr, ROWS: tl.constexpr = 1,
                 ONE_PASS: tl.constexpr = False):
    """A decode program's normalised rows (row ``r``: token ``tok[r]``, query head
    ``head[r]``): the output itself without splits; else its partial and log-sum-exp, and
    with ``MERGE`` the last of the ``active`` splits of its (sequence, KV head) to arrive
    merges them and zeroes the counter for the next call. ``GATED``: the output (not the
    partials) is multiplied by ``sigmoid(gate)``. ``ROWS``: tokens a sequence brings."""
    seen = l_i > 0.0
    o = acc / tl.where(seen, l_i, 1.0)[:, None]
    toks = tok.to(tl.int64)
    if not SPLIT:
        dest = toks[:, None] * stride_ot + head[:, None] * stride_oh + offs_dv[None, :]
        mask = row_ok[:, None] & dv_ok[None, :]
        if GATED:
            o = _gate_rows(o, gate_ptr, toks, head, offs_dv, mask, stride_gt, stride_gh, out_ptr.dtype.element_ty)
        tl.store(out_ptr + dest, o.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        part = split * stride_ps + toks[:, None] * stride_pt + head[:, None] * stride_ph + offs_dv[None, :]
        tl.store(part_o_ptr + part, o, mask=row_ok[:, None] & dv_ok[None, :])
        lse = tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + split * stride_ls + toks * stride_lt + head, lse, mask=row_ok)
        if MERGE:
            tl.debug_barrier()  # every thread's partial is stored before the counter moves
            counter = count_ptr + seq * num_kv_heads + kv_head
            if tl.atomic_add(counter, 1, sem="acq_rel") == active - 1:
                _merge_partials(part_o_ptr, part_lse_ptr, out_ptr, gate_ptr, seq, kv_head, active,
                                stride_ps, stride_pt, stride_ph, stride_ls, stride_lt, stride_ot, stride_oh,
                                stride_gt, stride_gh, GROUP, HEAD_DV, BLOCK_G, BLOCK_S, MERGE_S, BLOCK_DV, GATED,
                                ROWS, ONE_PASS)
                tl.store(counter, 0)


def decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    rotary_dim: int,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: ForwardBatch,
    scale: float,
    gate: torch.Tensor | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Same contract as the reference (batches :func:`fits_rows` admits). ``num_splits``
    overrides the key-split heuristic, as ``NINFER_DECODE_SPLITS`` does (read per call, for
    A/B runs inside whole steps)."""
    num_splits = num_splits or forced("NINFER_DECODE_SPLITS") or None
    num_tokens, num_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = k_cache.shape
    head_dim_v = v_cache.shape[-1]
    num_seqs = batch.seq_lens.shape[0]
    rows = batch.max_query_len
    if num_seqs * rows != num_tokens or not fits_rows(num_heads // max(num_kv_heads, 1), rows, fused_verify=True):
        raise ValueError(f"decode_attention takes {num_seqs} sequences of the same number of rows (1 to "
                         f"{MAX_ROWS}, at most {MAX_GROUP_ROWS} rows a KV head), got {num_tokens} rows of up to "
                         f"{rows} a sequence")
    if num_heads % num_kv_heads or k.shape[1] != num_kv_heads:
        raise ValueError(f"{num_heads} query heads do not group onto {num_kv_heads} KV heads")
    if page_size & (page_size - 1):
        raise ValueError(f"page size must be a power of two, got {page_size}")
    check_rotary_dim(rotary_dim, head_dim, cos_sin)
    if any(t.stride(-1) != 1 for t in (q, k, v, k_cache, v_cache, cos_sin)):
        raise ValueError("q, k, v, the caches and the cos/sin table must be contiguous in their last dimension")
    out = torch.empty(num_tokens, num_heads, head_dim_v, dtype=q.dtype, device=q.device)
    gate_arg, gate_strides = gate_args(gate, out)
    if num_seqs == 0:
        return out
    group = num_heads // num_kv_heads
    tuned = None if num_splits else tuned_launch(str(k_cache.dtype).removeprefix("torch."), head_dim, num_seqs,
                                                 batch.max_seq_len, MIN_KEYS_PER_SPLIT, q.device)
    if tuned is not None:
        splits, block_n, num_warps, num_stages = tuned.splits, tuned.block_n, tuned.num_warps, tuned.num_stages
    else:
        splits = num_splits or _num_splits(num_seqs * num_kv_heads, batch.max_seq_len, q.device, MAX_SPLITS,
                                           MIN_KEYS_PER_SPLIT)
        num_warps, num_stages, block_n, small_block_n, small_tile_splits = launch_shape(head_dim)
        block_n = small_block_n if splits >= small_tile_splits else block_n
    # an A/B switch, read per call: at batch 1 and 16 partials the merging program holds
    # 256 floats a thread on the default warps, and ptxas (sm_90, triton 3.6) spills 508
    # bytes at head dim 128 on 2 warps (8 on 4) and 456 at 256 on 4 warps (228 on 8)
    num_warps = forced("NINFER_DECODE_WARPS") or num_warps
    if splits > 1:
        part_o = torch.empty(splits, num_tokens, num_heads, head_dim_v, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(splits, num_tokens, num_heads, dtype=torch.float32, device=q.device)
    else:
        part_o = part_lse = out  # unused when SPLIT is off
    counters = counter_buffer("decode_attention", q.device, num_seqs * num_kv_heads, minimum=1 << 16)
    row_tile = triton.next_power_of_2(group * rows)  # (token, head-in-group) rows of a program
    # the merge holds MERGE_S partials of every row at once: as many values with more rows
    merge_s = max(1, min(merge_splits(), triton.next_power_of_2(splits)) // triton.next_power_of_2(rows))
    if rows > 1:
        # verify rows hold several tokens' rows a program: at decode's warps the registers
        # spill (ptxas, triton 3.6, sm_90: 192 bytes at the 8B's head dim 128 on 2 warps,
        # 2.5 KB at 256 on 4 warps; none with 4 and 8 warps, one partial a merge pass at 256)
        num_warps = max(num_warps, 8 if head_dim > 128 else 4)
        merge_s = 1 if head_dim > 128 else merge_s
    use_pdl = pdl.enabled(q.device)
    _decode_kernel[(num_seqs, num_kv_heads, splits)](
        q, k, v, q_weight.contiguous(), k_weight.contiguous(), positions, cos_sin,
        k_cache, v_cache, batch.slot_mapping, batch.seq_lens, batch.block_tables,
        out, part_o, part_lse, counters, gate_arg,
        scale * math.log2(math.e), eps, num_kv_heads, splits,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos_sin.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        out.stride(0), out.stride(1), part_o.stride(0), part_o.stride(1), part_o.stride(2),
        part_lse.stride(0), part_lse.stride(1), batch.block_tables.stride(0), *gate_strides,
        GROUP=group, PAGE=page_size, HEAD_D=head_dim, HEAD_DV=head_dim_v, HALF=rotary_dim // 2, ROT=rotary_dim,
        BLOCK_M=max(16, row_tile), BLOCK_N=block_n,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)), BLOCK_DV=max(16, triton.next_power_of_2(head_dim_v)),
        BLOCK_G=row_tile, BLOCK_S=triton.next_power_of_2(splits),
        MERGE_S=merge_s,
        SPLIT=splits > 1, IEEE=q.dtype == torch.float32,
        # Triton's interpreter (CPU tensors) multiplies bf16 dot operands as raw bits.
        UPCAST=q.device.type != "cuda" and q.dtype == torch.bfloat16, GATED=gate is not None, USE_PDL=use_pdl,
        ROWS=rows, KROWS=max(2, triton.next_power_of_2(rows)), num_warps=num_warps,
        ONE_PASS_KEYS=(forced("NINFER_DECODE_ONE_PASS_KEYS") or ONE_PASS_KEYS) if rows == 1 else 1,
        num_stages=num_stages, **pdl.launch_options(use_pdl),
    )
    return out



def gate_args(gate: torch.Tensor | None, out: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int]]:
    """The output gate's pointer and row strides for a decode kernel (``out`` and zeros
    stand in without a gate: ``GATED`` is off then and nothing reads them)."""
    if gate is None:
        return out, (0, 0)
    if gate.shape != out.shape or gate.stride(-1) != 1:
        raise ValueError(f"the output gate must be shaped like the output {tuple(out.shape)} and contiguous in its "
                         f"last dimension, got {tuple(gate.shape)} with strides {gate.stride()}")
    return gate, (gate.stride(0), gate.stride(1))


def launch_shape(head_dim: int) -> tuple[int, int, int, int, int]:
    """:data:`LAUNCH_SHAPES`' entry for ``head_dim`` (the nearest smaller one without its own)."""
    fits = [d for d in LAUNCH_SHAPES if d <= head_dim]
    return LAUNCH_SHAPES[max(fits) if fits else min(LAUNCH_SHAPES)]
