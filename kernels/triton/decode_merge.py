"""How a split decode launch ends: the last of a (sequence, KV head)'s key splits to
finish merges the others' partial rows, weighting each by its share of the row's softmax
mass (the separate merge kernel of :mod:`.paged_attention` does the same in its own
launch), and applies the output gate. Shared by the plain cache's kernel
(:mod:`.decode_attention`) and the quantized one (:mod:`.kv_quant_decode`).

Three ways to read the partials: all at once (a launch of at most ``MERGE_S`` splits);
passes with a running max, each reading its log-sum-exps and partials together
(``ONE_PASS``, the plain cache's one-token rows by default: short contexts then fill at
most ``MERGE_S`` splits and merge in one pass, see ``ONE_PASS_KEYS`` in
:mod:`.decode_attention`); or every log-sum-exp first and then passes of ``MERGE_S``
(the quantized kernel and verify rows).

With ``ONE_PASS``, a merge of no more than ``MERGE_S`` partials takes the all-at-once
read rather than the loop, though the loop would run once: carrying the running max and
sum through a loop costs registers. Compiled for sm_90 (triton 3.6, ptxas), the short
path's spill instructions after the counter fall from 152 to 30 at head dim 256 on 4
warps (16 splits, merged all at once, have 33) and from 166 to 43 at 128 on 2.
Untimed; 16 splits in all, which merge that way, ran 1.1% faster than the loop on the
35B-A3B in session 45.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ninfer_kernels.triton.paged_attention import gate_tile


@triton.jit
def _gate_rows(o, gate_ptr, toks, heads, offs_dv, mask, stride_gt, stride_gh, DT: tl.constexpr):
    """Output rows ``o`` (fp32; token ``toks``, head ``heads`` each) times ``sigmoid(gate)``,
    both rounded to the output dtype first, as the unfused ops
    (:func:`ninfer_kernels.attention.output_gate`) round them."""
    return gate_tile(o, gate_ptr, toks.to(tl.int64) * stride_gt + heads.to(tl.int64) * stride_gh, offs_dv, mask, DT)


@triton.jit
def _merge_partials(part_o_ptr, part_lse_ptr, out_ptr, gate_ptr, seq, kv_head, num_parts,
                    stride_ps, stride_pt, stride_ph, stride_ls, stride_lt, stride_ot, stride_oh, stride_gt, stride_gh,
                    GROUP: tl.constexpr, HEAD_DV: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_S: tl.constexpr,
                    MERGE_S: tl.constexpr, BLOCK_DV: tl.constexpr, GATED: tl.constexpr, ROWS: tl.constexpr = 1,
                    ONE_PASS: tl.constexpr = False):
    """Weight each of the first ``num_parts`` partials by its share of the row's softmax
    mass (as the separate merge kernel of :mod:`.paged_attention` does), for one group of
    heads (of each of the sequence's ``ROWS`` tokens). Up to ``MERGE_S`` splits, the
    log-sum-exps and the partial outputs are read together; past that, the outputs are
    read ``MERGE_S`` splits at a time after the log-sum-exps (all at once would not fit a
    2-warp program's registers), or with ``ONE_PASS`` in :func:`_merge_online`'s passes
    (``ONE_PASS`` reads up to ``MERGE_S`` partials together however many splits the
    launch has)."""
    g = tl.arange(0, BLOCK_G)
    g_ok = g < GROUP * ROWS
    heads = kv_head * GROUP + g % GROUP
    toks = seq * ROWS + g // GROUP
    dv = tl.arange(0, BLOCK_DV)
    dv_ok = dv < HEAD_DV
    lse_rows = part_lse_ptr + toks[None, :] * stride_lt + heads[None, :]
    part_rows = part_o_ptr + toks[None, :, None] * stride_pt + heads[None, :, None] * stride_ph + dv[None, None, :]
    if MERGE_S == BLOCK_S:
        merged = _merge_one_pass(lse_rows, part_rows, num_parts, g_ok, dv_ok, stride_ls, stride_ps, MERGE_S)
    elif ONE_PASS:  # one pass at short contexts, where few splits hold keys (see _split_keys)
        if num_parts <= MERGE_S:  # no running state to carry: fewer registers (module docstring)
            merged = _merge_one_pass(lse_rows, part_rows, num_parts, g_ok, dv_ok, stride_ls, stride_ps, MERGE_S)
        else:
            merged = _merge_online(lse_rows, part_rows, num_parts, g_ok, dv_ok, stride_ls, stride_ps, BLOCK_G,
                                   MERGE_S, BLOCK_DV)
    else:
        merged = _merge_in_passes(lse_rows, part_rows, num_parts, g_ok, dv_ok, stride_ls, stride_ps, BLOCK_G,
                                  BLOCK_S, MERGE_S, BLOCK_DV)
    dest = out_ptr + toks[:, None] * stride_ot + heads[:, None] * stride_oh + dv[None, :]
    mask = g_ok[:, None] & dv_ok[None, :]
    if GATED:
        merged = _gate_rows(merged, gate_ptr, toks, heads, dv, mask, stride_gt, stride_gh, out_ptr.dtype.element_ty)
    tl.store(dest, merged.to(out_ptr.dtype.element_ty), mask=mask)



@triton.jit
def _merge_one_pass(lse_rows, part_rows, num_parts, g_ok, dv_ok, stride_ls, stride_ps, S: tl.constexpr):
    """The merge of at most ``S`` partials, their log-sum-exps and outputs read together:
    one round trip to L2 (.cg: where the other programs' partials are, never a stale L1
    line), where the passes of the general merge wait for one after another."""
    s = tl.arange(0, S)
    sg_ok = (s < num_parts)[:, None] & g_ok[None, :]
    lse = tl.load(lse_rows + s[:, None] * stride_ls, mask=sg_ok, other=float("-inf"), cache_modifier=".cg")
    parts = tl.load(part_rows + s[:, None, None] * stride_ps, mask=sg_ok[:, :, None] & dv_ok[None, None, :],
                    other=0.0, cache_modifier=".cg")
    # Split 0 always holds key 0, which every row sees, so a real row's max is finite.
    top = tl.where(g_ok, tl.max(lse, 0), 0.0)
    w = tl.exp2(lse - top[None, :])
    total = tl.sum(w, 0)
    scale = 1.0 / tl.where(total > 0, total, 1.0)
    return tl.sum(parts * (w * scale[None, :])[:, :, None], 0)


@triton.jit
def _merge_in_passes(lse_rows, part_rows, num_parts, g_ok, dv_ok, stride_ls, stride_ps, BLOCK_G: tl.constexpr,
                     BLOCK_S: tl.constexpr, MERGE_S: tl.constexpr, BLOCK_DV: tl.constexpr):
    """The merge of up to ``BLOCK_S`` partials: every log-sum-exp first, then the outputs
    ``MERGE_S`` splits a pass."""
    s = tl.arange(0, BLOCK_S)
    sg_ok = (s < num_parts)[:, None] & g_ok[None, :]
    lse = tl.load(lse_rows + s[:, None] * stride_ls, mask=sg_ok, other=float("-inf"), cache_modifier=".cg")
    top = tl.where(g_ok, tl.max(lse, 0), 0.0)  # (finite for a real row, see _merge_one_pass)
    total = tl.sum(tl.exp2(lse - top[None, :]), 0)
    scale = 1.0 / tl.where(total > 0, total, 1.0)
    merged = tl.zeros([BLOCK_G, BLOCK_DV], dtype=tl.float32)
    for first in tl.static_range(0, BLOCK_S, MERGE_S):
        sc = first + tl.arange(0, MERGE_S)
        sc_ok = (sc < num_parts)[:, None] & g_ok[None, :]
        lse_c = tl.load(lse_rows + sc[:, None] * stride_ls, mask=sc_ok, other=float("-inf"), cache_modifier=".cg")
        parts = tl.load(part_rows + sc[:, None, None] * stride_ps, mask=sc_ok[:, :, None] & dv_ok[None, None, :],
                        other=0.0, cache_modifier=".cg")
        merged += tl.sum(parts * (tl.exp2(lse_c - top[None, :]) * scale[None, :])[:, :, None], 0)
    return merged


@triton.jit
def _merge_online(lse_rows, part_rows, num_parts, g_ok, dv_ok, stride_ls, stride_ps, BLOCK_G: tl.constexpr,
                  MERGE_S: tl.constexpr, BLOCK_DV: tl.constexpr):
    """The merge in passes of ``MERGE_S`` partials, each pass's log-sum-exps and outputs
    read together and folded in with a running max (as attention folds key tiles): one
    round trip a pass, and only as many passes as splits hold keys, where
    :func:`_merge_in_passes` reads every log-sum-exp first and then runs all its passes."""
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_G], dtype=tl.float32)
    merged = tl.zeros([BLOCK_G, BLOCK_DV], dtype=tl.float32)
    for first in range(0, num_parts, MERGE_S):
        sc = first + tl.arange(0, MERGE_S)
        sc_ok = (sc < num_parts)[:, None] & g_ok[None, :]
        lse = tl.load(lse_rows + sc[:, None] * stride_ls, mask=sc_ok, other=float("-inf"), cache_modifier=".cg")
        parts = tl.load(part_rows + sc[:, None, None] * stride_ps, mask=sc_ok[:, :, None] & dv_ok[None, None, :],
                        other=0.0, cache_modifier=".cg")
        # a padding row's max stays -inf: take 0 for it, so no -inf - -inf
        top = tl.maximum(m, tl.max(lse, 0))
        top = tl.where(top == float("-inf"), 0.0, top)
        alpha = tl.exp2(m - top)
        w = tl.exp2(lse - top[None, :])
        total = total * alpha + tl.sum(w, 0)
        merged = merged * alpha[:, None] + tl.sum(parts * w[:, :, None], 0)
        m = top
    return merged / tl.where(total > 0, total, 1.0)[:, None]
