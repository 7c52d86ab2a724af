"""Speculative verify rows inside the fused Gated DeltaNet mixer (:mod:`.gated_delta_decode`).

A verify row is ``W`` tokens of one sequence (its last committed token and ``W - 1``
drafts), and the program must leave the state and the conv history after each of them
in that token's own row. Everything a token needs besides the running state depends
only on what the projection and the slot held before the launch: the conv inputs of
every token, its gates, its output gate, and the history each token leaves. So all of it
is read up front, as ``[W, ...]`` tiles in a few loads whose latencies overlap, and the
token loop keeps only the delta rule and stores. Token by token, the decode loop's
structure paid a round trip to memory for each token's inputs and another for its
history, after the previous token's stores (which may alias the history pool's rows).

The arithmetic is the decode loop's, term for term (see :mod:`.gated_delta_decode`).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ninfer_kernels.triton.gated_delta_parts import _delta_step, _round, _store_output


@triton.jit
def _window(x_ptr, hist_ptr, start, rel, ok, stride_x, stride_hist, cols, col_ok, hist_ok, K: tl.constexpr):
    """The inputs at positions ``start + rel`` (a 2-D tile of relative positions, ``ok`` and
    ``hist_ok`` broadcast to it: where wanted, and whether the slot has a history) for
    channels ``cols``: [*rel's shape, B], from the projection rows at or after ``start`` and
    from the slot's history before it (zeros without one), in the history's dtype."""
    in_x = rel >= 0
    hist = K - 1 + rel
    m = ok[:, :, None] & col_ok[None, None, :]
    xv = tl.load(x_ptr + (start + rel)[:, :, None] * stride_x + cols[None, None, :],
                 mask=m & in_x[:, :, None], other=0.0)
    sv = tl.load(hist_ptr + hist[:, :, None] * stride_hist + cols[None, None, :],
                 mask=m & ((~in_x) & (hist >= 0) & hist_ok)[:, :, None], other=0.0)
    return tl.where(in_x[:, :, None], xv.to(hist_ptr.dtype.element_ty), sv)


@triton.jit
def _histories(x_ptr, hist_ptr, start, ok, stride_x, stride_hist, cols, col_ok, hist_ok,
               WP: tl.constexpr, K: tl.constexpr, KP: tl.constexpr):
    """The history each token leaves for channels ``cols``: [WP, KP, B], row ``r`` of token
    ``i``'s being the input at ``i - (K - 2) + r`` (rows past ``K - 2`` unused), in the
    history's dtype; ``ok`` [WP]: the tokens (and programs) that want it."""
    i = tl.arange(0, WP)
    r = tl.arange(0, KP)
    return _window(x_ptr, hist_ptr, start, i[:, None] - (K - 2) + r[None, :], ok[:, None] & (r < K - 1)[None, :],
                   stride_x, stride_hist, cols, col_ok, hist_ok[:, None], K)


@triton.jit
def _conv_tokens(x_ptr, hist_ptr, w, start, stride_x, stride_hist, cols, col_ok, hist_ok,
                 W: tl.constexpr, WP: tl.constexpr, K: tl.constexpr, KP: tl.constexpr):
    """silu(conv) of each of the ``W`` tokens for channels ``cols`` with taps ``w`` [B, KP]:
    [WP, B] float32 (the decode loop's ``_conv_row`` for all of them, a tap at a time)."""
    i = tl.arange(0, WP)
    taps = tl.arange(0, KP)
    acc = tl.zeros([WP, w.shape[0]], dtype=tl.float32)
    for j in tl.static_range(K):
        x = _window(x_ptr, hist_ptr, start, (i - (K - 1) + j)[:, None], (i < W)[:, None], stride_x, stride_hist,
                    cols, col_ok, hist_ok[:, None], K)
        w_j = tl.sum(tl.where(taps[None, :] == j, w, 0.0), 1)
        acc += tl.sum(x.to(tl.float32), axis=1) * w_j[None, :]  # (the [WP, 1, B] window as [WP, B]: exact)
    return acc / (1.0 + tl.exp(-acc))


@triton.jit
def _pick(tile, i, t):
    """Row ``t`` of a [WP, B] register tile (``i``: its row indices)."""
    return tl.sum(tl.where((i == t)[:, None], tile, 0.0), 0)


@triton.jit
def _verify_tokens(
    proj_ptr, hist_ptr, conv_ptr, ssm_ptr, out_ptr, sumsq_ptr, rows_ptr,
    s, w_q, w_k, w_v, neg_a, dt_bias, seq, head, part, start, hist_ok,
    q_cols, k_cols, v_cols, dk, dv, dk_ok, dv_ok, s_mask, nw, eps, l2_eps, scale,
    stride_p, stride_cs, stride_ch, stride_ss, stride_sh, stride_sk, stride_o, stride_rows,
    HV: tl.constexpr, GROUP: tl.constexpr, DV: tl.constexpr, CONV: tl.constexpr,
    K: tl.constexpr, KP: tl.constexpr, W: tl.constexpr, WP: tl.constexpr, NV: tl.constexpr,
    ROUND_SCALE: tl.constexpr, BF16: tl.constexpr,
):
    """The ``W`` tokens of one verify row from state ``s`` (the slot's, only read): each
    token's output row, and the state and the history after it stored to its own row
    (``rows_ptr``); the history of the q/k channels by the first program of each key head."""
    dtype = out_ptr.dtype.element_ty
    i = tl.arange(0, WP)
    i_ok = i < W
    hist_ok = (i * 0 + tl.max(hist_ok.to(tl.int32), 0)) > 0  # the taps' flag, as a [WP] vector
    # everything that does not depend on the running state, for every token at once
    q_all = _round(_conv_tokens(proj_ptr, hist_ptr, w_q, start, stride_p, stride_ch, q_cols, dk_ok, hist_ok,
                                W, WP, K, KP), dtype, BF16)
    k_all = _round(_conv_tokens(proj_ptr, hist_ptr, w_k, start, stride_p, stride_ch, k_cols, dk_ok, hist_ok,
                                W, WP, K, KP), dtype, BF16)
    v_all = _round(_conv_tokens(proj_ptr, hist_ptr, w_v, start, stride_p, stride_ch, v_cols, dv_ok, hist_ok,
                                W, WP, K, KP), dtype, BF16)
    token_rows = proj_ptr + (start + i) * stride_p
    z_all = tl.load(token_rows[:, None] + CONV + head * DV + dv[None, :], mask=i_ok[:, None] & dv_ok[None, :],
                    other=0.0).to(tl.float32)
    b_all = tl.load(token_rows + CONV + HV * DV + head, mask=i_ok, other=0.0).to(tl.float32)
    a_all = tl.load(token_rows + CONV + HV * DV + HV + head, mask=i_ok, other=0.0).to(tl.float32) + dt_bias
    dest_rows = tl.load(rows_ptr + seq * stride_rows + i, mask=i_ok, other=0).to(tl.int64)
    # the history each token leaves (its last K - 1 inputs); the q/k channels' only from the
    # first program of each key head, the one that writes them (the others load nothing)
    qk_writer = i_ok & ((i * 0 + head % GROUP + part) == 0)
    hist_v = _histories(proj_ptr, hist_ptr, start, i_ok, stride_p, stride_ch, v_cols, dv_ok, hist_ok, WP, K, KP)
    hist_q = _histories(proj_ptr, hist_ptr, start, qk_writer, stride_p, stride_ch, q_cols, dk_ok, hist_ok, WP, K, KP)
    hist_k = _histories(proj_ptr, hist_ptr, start, qk_writer, stride_p, stride_ch, k_cols, dk_ok, hist_ok, WP, K, KP)

    for t in tl.static_range(W):
        q = _pick(q_all, i, t)
        k = _pick(k_all, i, t)
        v = _pick(v_all, i, t)
        z = _pick(z_all, i, t)
        b = tl.sum(tl.where(i == t, b_all, 0.0))
        a = tl.sum(tl.where(i == t, a_all, 0.0))
        s, o = _delta_step(s, q, k, v, b, a, neg_a, l2_eps, scale, dtype, BF16)
        _store_output(o, z, nw, eps, out_ptr, sumsq_ptr, start + t, head, part, dv, dv_ok, stride_o, HV, DV, NV,
                      ROUND_SCALE, BF16)
        row = tl.sum(tl.where(i == t, dest_rows, 0))
        tl.store(ssm_ptr + row * stride_ss + head * stride_sh + dk[:, None] * stride_sk + dv[None, :],
                 s.to(ssm_ptr.dtype.element_ty), mask=s_mask)

    r = tl.arange(0, KP)
    dest = conv_ptr + dest_rows[:, None, None] * stride_cs + r[None, :, None] * stride_ch
    rows_ok = (r < K - 1)[None, :, None]
    tl.store(dest + v_cols[None, None, :], hist_v, mask=i_ok[:, None, None] & rows_ok & dv_ok[None, None, :])
    qk_mask = qk_writer[:, None, None] & rows_ok & dk_ok[None, None, :]
    tl.store(dest + q_cols[None, None, :], hist_q, mask=qk_mask)
    tl.store(dest + k_cols[None, None, :], hist_k, mask=qk_mask)
