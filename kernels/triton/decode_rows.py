"""The new rows of a decode or verify step inside the one-launch attention kernels.

:mod:`.decode_attention` and :mod:`.kv_quant_decode` take q/k/v straight from the
projection, so the per-head RMSNorm and RoPE run in the kernel: each dim is paired with its
rotation partner by a second (cached) load, so a row comes out whole, ready for a dot
product. The new keys are never read back from their page: the program holding them
folds them in from registers, each into the rows that may see it. With several tokens a
sequence (speculative verify rows) every query and key turns by its own position.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _rotation_partner(HEAD_D: tl.constexpr, HALF: tl.constexpr, ROT: tl.constexpr, BLOCK_D: tl.constexpr):
    """Each dim's RoPE partner (itself past the rotary part) and whether it is in the first half."""
    d = tl.arange(0, BLOCK_D)
    first = d < HALF
    return tl.where(first, d + HALF, tl.where(d < ROT, d - HALF, d)), first


@triton.jit
def _norm_rope_factors(w_ptr, cs_row, HEAD_D: tl.constexpr, HALF: tl.constexpr, ROT: tl.constexpr,
                       BLOCK_D: tl.constexpr):
    """The norm weight (per dim and per partner dim), cos, and sin negated in the first half,
    for one position: [BLOCK_D] each, float32. None of it comes from the kernel before, so
    callers read it before the wait."""
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_D
    rotated = d < ROT
    partner, first = _rotation_partner(HEAD_D, HALF, ROT, BLOCK_D)
    w = tl.load(w_ptr + d, mask=d_ok, other=0.0).to(tl.float32)
    wp = tl.load(w_ptr + partner, mask=d_ok, other=0.0).to(tl.float32)
    j = tl.where(first, d, d - HALF)
    cos = tl.load(cs_row + j, mask=rotated, other=1.0).to(tl.float32)
    sin = tl.load(cs_row + HALF + j, mask=rotated, other=0.0).to(tl.float32)
    return w, wp, cos, tl.where(first, -sin, sin)


@triton.jit
def _norm_rope_rows(x_ptr, row_offs, row_ok, w, wp, cos, signed_sin, eps,
                    HEAD_D: tl.constexpr, HALF: tl.constexpr, ROT: tl.constexpr, BLOCK_D: tl.constexpr):
    """RMSNorm then RoPE of rows starting at ``x_ptr + row_offs``, all at one position: [R,
    BLOCK_D], with the factors from :func:`_norm_rope_factors` (see :func:`_norm_rope_tile`)."""
    return _norm_rope_tile(x_ptr, row_offs, row_ok, w, wp, cos[None, :], signed_sin[None, :], eps, HEAD_D, HALF,
                           ROT, BLOCK_D)


@triton.jit
def _tile_factors(w_ptr, pos_ptr, cos_sin_ptr, tok, tok_ok, stride_cs, HEAD_D: tl.constexpr, HALF: tl.constexpr,
                  ROT: tl.constexpr, BLOCK_D: tl.constexpr):
    """:func:`_norm_rope_factors` for rows of several tokens (row ``r``: token ``tok[r]``,
    each at its own position): the norm weights [BLOCK_D] as there, cos and the signed sin
    [R, BLOCK_D]. Positions, the rotary table and the weights are never what the kernel
    before wrote, so verify rows read all of them before the wait in a few gathers, instead
    of a position, then its table row, per token after it."""
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_D
    partner, first = _rotation_partner(HEAD_D, HALF, ROT, BLOCK_D)
    w = tl.load(w_ptr + d, mask=d_ok, other=0.0).to(tl.float32)
    wp = tl.load(w_ptr + partner, mask=d_ok, other=0.0).to(tl.float32)
    pos = tl.load(pos_ptr + tok, mask=tok_ok, other=0).to(tl.int64)
    j = tl.where(first, d, d - HALF)
    cs_rows = cos_sin_ptr + pos[:, None] * stride_cs + j[None, :]
    m = tok_ok[:, None] & (d < ROT)[None, :]
    cos = tl.load(cs_rows, mask=m, other=1.0).to(tl.float32)
    sin = tl.load(cs_rows + HALF, mask=m, other=0.0).to(tl.float32)
    return w, wp, cos, tl.where(first[None, :], -sin, sin)


@triton.jit
def _norm_rope_tile(x_ptr, row_offs, row_ok, w, wp, cos, signed_sin, eps,
                    HEAD_D: tl.constexpr, HALF: tl.constexpr, ROT: tl.constexpr, BLOCK_D: tl.constexpr):
    """RMSNorm then RoPE of rows starting at ``x_ptr + row_offs``: [R, BLOCK_D], with the norm
    weights per dim and per partner dim [BLOCK_D] and each row's cos and signed sin
    (``[R, BLOCK_D]`` from :func:`_tile_factors`, or one row broadcast to all).

    Each dim is paired with its rotation partner by a second (cached) load instead of
    splitting the row into halves, so the result is a whole row ready for a dot product.
    Rounding follows the unfused ops: normalised values in the input dtype, then rotated.
    """
    dtype = x_ptr.dtype.element_ty
    d = tl.arange(0, BLOCK_D)
    partner, first = _rotation_partner(HEAD_D, HALF, ROT, BLOCK_D)
    m = row_ok[:, None] & (d < HEAD_D)[None, :]
    x = tl.load(x_ptr + row_offs[:, None] + d[None, :], mask=m, other=0.0).to(tl.float32)
    xp = tl.load(x_ptr + row_offs[:, None] + partner[None, :], mask=m, other=0.0).to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(x * x, 1) / HEAD_D + eps)
    n = (x * inv[:, None] * w[None, :]).to(dtype).to(tl.float32)
    n_partner = (xp * inv[:, None] * wp[None, :]).to(dtype).to(tl.float32)
    return (n * cos + n_partner * signed_sin).to(dtype)


@triton.jit
def _new_keys_tile(acc, m_i, l_i, q, t, k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, new_tok, new_ok, slots,
                   kw, kwp, k_cos, k_sin, kv_head, qk_scale, eps, stride_kt, stride_kh, stride_vt, stride_vh,
                   stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch, offs_d, offs_dv, d_ok,
                   dv_ok, ROWS: tl.constexpr, KROWS: tl.constexpr, PAGE: tl.constexpr, HEAD_D: tl.constexpr,
                   HALF: tl.constexpr, ROT: tl.constexpr, BLOCK_D: tl.constexpr):
    """A verify sequence's ``ROWS`` new keys and values (``KROWS`` tile rows ``new_tok``, KV slots
    ``slots``, their rotary factors read before the wait): normalised and turned each at
    its own position in one pass, stored at their slots (-1: nothing), then folded from
    registers into the rows of its token and the later ones (row token ``t`` sees new key
    ``j`` when ``j <= t``)."""
    kdt = k_cache_ptr.dtype.element_ty
    vdt = v_cache_ptr.dtype.element_ty
    keys = _norm_rope_tile(k_ptr, new_tok * stride_kt + kv_head * stride_kh, new_ok, kw, kwp, k_cos, k_sin, eps,
                           HEAD_D, HALF, ROT, BLOCK_D).to(kdt)
    values = tl.load(v_ptr + new_tok[:, None] * stride_vt + kv_head * stride_vh + offs_dv[None, :],
                     mask=new_ok[:, None] & dv_ok[None, :], other=0.0).to(vdt)
    stored = new_ok & (slots >= 0)
    page, offset = slots // PAGE, slots % PAGE
    tl.store(k_cache_ptr + page[:, None] * stride_kcb + offset[:, None] * stride_kcs + kv_head * stride_kch
             + offs_d[None, :], keys, mask=stored[:, None] & d_ok[None, :])
    tl.store(v_cache_ptr + page[:, None] * stride_vcb + offset[:, None] * stride_vcs + kv_head * stride_vch
             + offs_dv[None, :], values, mask=stored[:, None] & dv_ok[None, :])
    keys32, values32 = keys.to(tl.float32), values.to(tl.float32)
    r = tl.arange(0, KROWS)
    for j in tl.static_range(ROWS):  # row j of each tile, exactly (one term of each sum is nonzero)
        k_new = tl.sum(tl.where((r == j)[:, None], keys32, 0.0), 0)
        v_new = tl.sum(tl.where((r == j)[:, None], values32, 0.0), 0)
        acc, m_i, l_i = _fold_new_key(acc, m_i, l_i, q, k_new, v_new, qk_scale, t >= j, vdt)
    return acc, m_i, l_i


@triton.jit
def _fold_new_key(acc, m_i, l_i, q, k_new, v_new, qk_scale, visible, DT: tl.constexpr):
    """Fold a new key and value (rows of the program's one KV head) into the ``visible``
    rows from registers, exactly as a tile would fold them: the key, the value and the
    probabilities rounded to ``DT`` (the products' operand dtype), scores in log2 units."""
    s_new = tl.sum(q.to(tl.float32) * k_new.to(DT).to(tl.float32)[None, :], 1) * qk_scale
    s_new = tl.where(visible, s_new, float("-inf"))
    m_new = tl.maximum(m_i, s_new)
    # a row that has seen nothing yet (an empty cached range) keeps m = -inf: subtract 0 then
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p_new = tl.exp2(s_new - m_safe)
    l_i = l_i * alpha + p_new
    p_new = p_new.to(DT).to(tl.float32)
    acc = acc * alpha[:, None] + p_new[:, None] * v_new.to(DT).to(tl.float32)[None, :]
    return acc, m_new, l_i
