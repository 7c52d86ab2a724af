"""What the few-row tensor-core kernels (:mod:`.int4_mma`, :mod:`.fp8_mma`) share: where
an ``mma.sync`` m16n8k16 leaves its sums, how they are stored or summed over K parts, and
how many K parts a launch takes.

Both kernels give a warp 16 weight rows and up to eight rows of x as the MMA's B. Lane
``l`` (``g = l // 4``, ``t = l % 4``) gets D's rows ``g`` and ``g + 8`` at x rows ``2t``
and ``2t + 1``: in a ``[8 * num_warps, 16]`` tile of four values a lane, its slot ``u``
is weight row ``g + 8 (u >> 1)`` at x row ``2t + (u & 1)``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ninfer_kernels.triton.rounding import round_to

#: rows of x one launch covers (the MMA's n)
MMA_ROWS = 8
#: K columns a step of either kernel
STEP = 128


def mma_splits(n: int, k: int, num_warps: int, sms: int, tiles: int = 1) -> int:
    """K parts for about two programs an SM, each at least four steps."""
    programs = triton.cdiv(n, 16 * tiles * num_warps)
    return 1 if programs >= sms else max(1, min(triton.cdiv(2 * sms, programs), k // STEP // 4))


@triton.jit
def finish_tile(acc, rows_a, rows_b, c, M, N, b_ptr, out_ptr, part_ptr, counter, split, splits, stride_om,
                HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, ROUND: tl.constexpr):
    """Store a tile's outputs, or (split K) its part, the last part to arrive summing all of
    them in part order. Lane t's slot u is row g + 8 (u >> 1) of the tile at x row 2t + (u & 1)."""
    u = c % 4
    w_row = tl.where((u >> 1) == 1, rows_b[:, None], rows_a[:, None])
    x_row = 2 * (c // 4) + (u & 1)
    ok = (w_row < N) & (x_row < M)
    dest = out_ptr + x_row.to(tl.int64) * stride_om + w_row
    if not SPLIT_K:
        if HAS_BIAS:
            acc += tl.load(b_ptr + w_row, mask=ok, other=0.0).to(tl.float32)
        tl.store(dest, round_to(acc, out_ptr.dtype.element_ty, ROUND), mask=ok)
    else:
        parts = part_ptr + x_row * N + w_row
        tl.store(parts + split * M * N, acc, mask=ok)
        tl.debug_barrier()  # every thread's part is stored before the counter moves
        if tl.atomic_add(counter, 1, sem="acq_rel") == splits - 1:
            total = tl.zeros_like(acc)
            for s in range(splits):  # part order: the same sum every time
                total += tl.load(parts + s * M * N, mask=ok, other=0.0, cache_modifier=".cg")
            if HAS_BIAS:
                total += tl.load(b_ptr + w_row, mask=ok, other=0.0).to(tl.float32)
            tl.store(dest, round_to(total, out_ptr.dtype.element_ty, ROUND), mask=ok)
            tl.store(counter, 0)
