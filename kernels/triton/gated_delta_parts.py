"""Per-token pieces of the fused Gated DeltaNet mixer (:mod:`.gated_delta_decode`) that its
decode loop and its verify rows (:mod:`.gated_delta_verify`) share: rounding to the model
dtype, one token's conv from the projection rows and the slot's history, the history a
chunk leaves, one token's delta-rule step, and the gated RMSNorm of a head's output row."""

from __future__ import annotations

import triton
import triton.language as tl

from ninfer_kernels.triton.rounding import nearest_bf16


@triton.jit
def _round(x, dtype: tl.constexpr, BF16: tl.constexpr):
    """float32 ``x`` rounded to the model dtype (to nearest even), kept in float32.

    bf16 is rounded on the bits (:mod:`.rounding`), so the interpreter's tests see every
    rounding point too."""
    if BF16:
        return nearest_bf16(x)
    else:
        return x.to(dtype).to(tl.float32)


@triton.jit
def _inputs_at(x_ptr, hist_ptr, pos, ok, start, stride_x, stride_hist, cols, col_ok, has_history,
               K: tl.constexpr):
    """The inputs at positions ``pos`` [KP] (where ``ok``) for channels ``cols``, as two [B, KP]
    tiles, each zero where the other holds the value: from the chunk's rows (at or after
    ``start``) and from the slot's history before it (zeros without one); and which is which."""
    in_x = pos >= start
    hist = K - 1 + pos - start
    xv = tl.load(x_ptr + pos[None, :] * stride_x + cols[:, None],
                 mask=col_ok[:, None] & (ok & in_x)[None, :], other=0.0)
    sv = tl.load(hist_ptr + hist[None, :] * stride_hist + cols[:, None],
                 mask=col_ok[:, None] & (ok & ~in_x & (hist >= 0) & has_history)[None, :], other=0.0)
    return xv, sv, in_x


@triton.jit
def _conv_row(x_ptr, hist_ptr, w, t, start, stride_x, stride_hist, cols, col_ok, has_history,
              K: tl.constexpr, KP: tl.constexpr):
    """silu(conv) of token ``t`` for channels ``cols`` with taps ``w`` [B, KP]: [B] float32.

    Taps at rows before ``start`` come from the history (zero without one)."""
    taps = tl.arange(0, KP)
    xv, sv, _ = _inputs_at(x_ptr, hist_ptr, t - (K - 1) + taps, taps < K, start, stride_x, stride_hist, cols,
                           col_ok, has_history, K)
    acc = tl.sum((xv.to(tl.float32) + sv.to(tl.float32)) * w, axis=1)
    return acc / (1.0 + tl.exp(-acc))


@triton.jit
def _new_history(x_ptr, hist_ptr, start, end, stride_x, stride_hist, cols, col_ok, has_history,
                 K: tl.constexpr, KP: tl.constexpr):
    """The last K - 1 inputs after the chunk [B, KP] (rows past K - 2 unused), some still
    from the old history when the chunk is shorter than that."""
    rows = tl.arange(0, KP)
    xv, sv, in_x = _inputs_at(x_ptr, hist_ptr, end - (K - 1) + rows, rows < K - 1, start, stride_x, stride_hist,
                              cols, col_ok, has_history, K)
    return tl.where(in_x[None, :], xv.to(hist_ptr.dtype.element_ty), sv)


@triton.jit
def _store_history(hist_ptr, new, stride_hist, cols, col_ok, K: tl.constexpr, KP: tl.constexpr):
    rows = tl.arange(0, KP)
    tl.store(hist_ptr + rows[None, :] * stride_hist + cols[:, None], new,
             mask=col_ok[:, None] & (rows < K - 1)[None, :])


@triton.jit
def _gated_norm(o, sumsq, z, nw, eps, DV: tl.constexpr, dtype: tl.constexpr, ROUND_SCALE: tl.constexpr,
                BF16: tl.constexpr):
    """The gated RMSNorm of one head's output row ``o`` (float32, rounded) given its sum of squares."""
    normed = _round(o / tl.sqrt(sumsq / DV + eps), dtype, BF16)
    scaled = nw * normed
    if ROUND_SCALE:
        scaled = _round(scaled, dtype, BF16)
    return _round(scaled * (z / (1.0 + tl.exp(-z))), dtype, BF16)


@triton.jit
def _delta_step(s, q, k, v, b, a, neg_a, l2_eps, scale, dtype: tl.constexpr, BF16: tl.constexpr):
    """One token through the delta rule: the state ``s`` [Dk, BV] after it and the token's
    output row (rounded), from its conv outputs ``q``/``k``/``v``, its gate inputs ``b`` and
    ``a`` (``a`` with the head's dt bias added)."""
    beta = _round(1.0 / (1.0 + tl.exp(-b)), dtype, BF16)
    g = neg_a * tl.where(a > 20.0, a, tl.log(1.0 + tl.exp(a)))  # softplus, torch's threshold
    q = q / tl.sqrt(tl.sum(q * q) + l2_eps) * scale
    k = k / tl.sqrt(tl.sum(k * k) + l2_eps)
    s = s * tl.exp(g)
    delta = (v - tl.sum(s * k[:, None], axis=0)) * beta
    s = s + k[:, None] * delta[None, :]
    return s, _round(tl.sum(s * q[:, None], axis=0), dtype, BF16)


@triton.jit
def _store_output(o, z, nw, eps, out_ptr, sumsq_ptr, t, head, part, dv, dv_ok, stride_o, HV: tl.constexpr,
                  DV: tl.constexpr, NV: tl.constexpr, ROUND_SCALE: tl.constexpr, BF16: tl.constexpr):
    """Token ``t``'s output row of the program's value columns: gated-normed when the program
    holds the whole head; else ``o`` and its share of the sum of squares, for the head's last
    program to normalise."""
    dtype = out_ptr.dtype.element_ty
    if NV == 1:  # masked columns are zeros, so the sum is the head's
        y = _gated_norm(o, tl.sum(o * o), z, nw, eps, DV, dtype, ROUND_SCALE, BF16)
        tl.store(out_ptr + t * stride_o + head * DV + dv, y.to(dtype), mask=dv_ok)
    else:
        tl.store(out_ptr + t * stride_o + head * DV + dv, o.to(dtype), mask=dv_ok)
        tl.store(sumsq_ptr + (t * HV + head) * NV + part, tl.sum(o * o))
