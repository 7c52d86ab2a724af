"""int4 weights times up to eight rows of x on the tensor cores (``mma.sync`` m16n8k16),
straight from the row-major :class:`~ninfer_kernels.quant_formats.Int4Group` words.

Why: the packed one-row step (:mod:`.int4_fp16`) multiplies on the CUDA cores, about 25
sm_90 instructions a 32-bit weight word (eight weights) for nibbles, zero points, x's fp16
pairs, eight products and their fp32 sum. A Hopper SM streams 3.5 (H100) to 4.6 (H200)
such words a cycle from HBM and issues 128 thread-instructions a cycle, so that step
cannot keep up with the memory on the H200 and barely on the H100 (38-63% of copy
bandwidth). Here a word costs about 15: three shifts and four ``lop3`` make its eight
weights into MMA registers, two byte permutes pair x's columns to match, and one
``mma.sync`` per warp multiplies 32 such words by up to eight rows of x. On an H200
(session 27) the 27B's projections ran 1.0-1.4x as fast as the tuned packed step at one
row (44-52% of copy bandwidth) and 1.9-2.3x as fast as the 16-row tile at eight. Marlin
(IST-DASLab) showed the approach with a repacked layout; this kernel reads the layout the
checkpoint loaders already make, so nothing is repacked or held twice.

**Fragments.** The MMA's A is 16 weight rows by 16 K positions, B 16 positions by 8 rows
of x. Lane ``l`` (``g = l // 4``, ``t = l % 4``) holds A's rows ``g`` and ``g + 8`` at
positions ``2t, 2t + 1`` and ``2t + 8, 2t + 9``, B's column ``g`` at the same positions,
and gets D's rows ``g, g + 8`` at x rows ``2t, 2t + 1``. Which K column sits at which
position is ours to choose (a sum does not care) as long as A and B agree. A warp owns 16
weight rows; a step is 128 columns, lane ``t`` reading columns ``32 t .. 32 t + 31`` of
rows ``g`` and ``g + 8``: four words each, eight MMAs. For word ``i`` (columns ``c = 32 t
+ 8 i`` onward) ``lop3(word >> 4 s, 0x000f000f, 0x43004300)`` is the bf16 pair
``(128 + q[c + s], 128 + q[c + s + 4])``: shifts 0 and 4 feed one MMA (columns ``c, c + 4``
at positions ``2t, 2t + 1``, ``c + 1, c + 5`` at ``2t + 8, 2t + 9``), shifts 8 and 12 the
next, and ``prmt`` makes x's matching pairs from its loaded words.

**Zero points.** Weights enter the MMA as ``128 + q`` (bf16; ``1024 + q`` for fp16 x),
exact, with no subtraction: ``sum (q - z) x = sum (128 + q) x - (128 + z) sum x``, where
``sum x`` comes from a second MMA of the same x with an A of ones. A step is one scale
group (or part of one: groups are multiples of 128), so the group's zero point and scale
apply once a step: one MMA more a word instead of four subtractions. Products are exact
and the float32 sums keep ``(128 + z) sum x`` exact enough to subtract (with |x| up to
1e3 the difference is off by about 1e-5 of itself).

The kernel relies on Triton giving a ``[8 * num_warps, 16]`` int32 tile loaded 16 bytes a
thread the blocked layout ``sizePerThread [1, 4]``, ``threadsPerWarp [8, 4]``,
``warpsPerCTA [num_warps, 1]`` (lane ``l`` holds words ``4 (l % 4)`` onward of its warp's
row ``l // 4``), and ``pack=4`` handing one inline-asm call those four words:
``scripts/triton_ir.py`` shows the layout, and the GPU tests compare with the reference.
Under the interpreter (``EMULATE``) the same sums come from Triton operations on the same
tiles, so CPU tests check the addressing, the splits and where each output lands.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ninfer_kernels import quant_formats as qf
from ninfer_kernels.triton import pdl
from ninfer_kernels.triton.gemv_words import x_of
from ninfer_kernels.triton.mma_rows import (
    MMA_ROWS, STEP, finish_tiles, lane_loads_asm, lane_words, mma_splits, plan_launch, tile_rows, x_lanes,
)

# a step (mma_rows.STEP) is 128 columns: 16 words a row, four a lane
_STEP = tl.constexpr(STEP)
_X_DTYPES = (torch.bfloat16, torch.float16)


def enabled() -> bool:
    """``NINFER_INT4_MMA=0`` keeps int4 products of one to eight rows on the CUDA-core steps
    (read per call, for comparisons)."""
    return os.environ.get("NINFER_INT4_MMA", "1") != "0"


def launch_shape(rows: int) -> tuple[int, int]:
    """(warps, tiles a warp) by x's rows. H200, session 27 (``scripts/gpu_mma_ab.py``
    at the 27B's five projections): at one row 8 warps of one tile were best at three and
    within 3% at the other two; at eight rows 4 warps of two tiles were best at four, 8%
    off at the fifth."""
    return (8, 1) if rows <= 2 else (4, 2)


def takes(x: torch.Tensor, w: qf.Int4Group) -> bool:
    """Whether :func:`int4_mma_matmul` serves ``x`` times ``w``: one to eight rows of bf16 or
    fp16 x (rows 16-byte aligned), a 2-D weight with K a multiple of 128 and groups of 128
    times a power of two."""
    steps = w.group_size // STEP  # a power of two: a step's group is a shift
    # a weight row stride of a multiple of 16 words, which Triton's divisibility hint sees:
    # only then does it load a lane's four words at once, the layout the packs rely on (any
    # other stride would hand them words of other rows)
    return (x.dim() == 2 and 0 < x.shape[0] <= MMA_ROWS and x.dtype in _X_DTYPES and w.qweight.dim() == 2
            and steps > 0 and w.group_size % STEP == 0 and steps & (steps - 1) == 0 and w.shape[1] % STEP == 0
            and x.shape[1] == w.shape[1] and x.stride(1) == 1 and (x.shape[0] == 1 or x.stride(0) % 8 == 0)
            and x.data_ptr() % 16 == 0 and w.qweight.stride(1) == 1 and w.qweight.stride(0) % 16 == 0
            and w.qweight.data_ptr() % 16 == 0 and w.scales.stride(-1) == 1 and w.zeros.stride(-1) == 1)


def _pack_asm(ty: str, symmetric: bool, tiles: int = 1) -> str:
    """PTX for one step of a lane: for each of ``tiles`` 16-row tiles its four words of rows
    g and g + 8 (two MMAs each, into D), x's words once (into S, against ones), then
    ``acc += s (D - (magic + z) S)`` for the tile's four outputs. Operands, for T tiles:
    $0 .. $(4T - 1) the new accumulators (float32 bits; tile j's slot u at 4j + u: rows g, g,
    g+8, g+8 at x rows 2t, 2t+1, 2t, 2t+1); from W = 4T each tile's words, row g's then row
    g+8's (tile j's at W + 8j); from X = W + 8T x's words (four for each word: columns c ..
    c+7 in pairs, word i's j-th at X + 4j + i); from A = X + 16 the accumulators; from A + 4T
    the scale pairs (rows g, g+8), from A + 8T the zero-point pairs (tile j's at + 4j; only
    the first of each four read)."""
    magic = "0x43004300" if ty == "bf16" else "0x64006400"
    one = "0x3f803f80" if ty == "bf16" else "0x3c003c00"
    mma = f"mma.sync.aligned.m16n8k16.row.col.f32.{ty}.{ty}.f32"
    w0, x0 = 4 * tiles, 12 * tiles
    acc0, scale0, zero0 = x0 + 16, x0 + 16 + 4 * tiles, x0 + 16 + 8 * tiles
    body = []
    for i in range(4):
        xs = [f"${x0 + 4 * j + i}" for j in range(4)]
        for h in range(2):  # nibbles 2h, 2h+4 and 2h+1, 2h+5: columns c+2h, c+2h+4, c+2h+1, c+2h+5
            lo, hi = 8 * h, 8 * h + 4
            body.append(f"""prmt.b32 b0, {xs[h]}, {xs[h + 2]}, 0x5410;
prmt.b32 b1, {xs[h]}, {xs[h + 2]}, 0x7632;
{mma} {{e0, e1, e2, e3}}, {{one, one, one, one}}, {{b0, b1}}, {{e0, e1, e2, e3}};
""")
            for tile in range(tiles):
                wa, wb, d = f"${w0 + 8 * tile + i}", f"${w0 + 8 * tile + 4 + i}", f"d{tile}_"
                body.append(f"""{"mov.b32 ta, " + wa if h == 0 else f"shr.u32 ta, {wa}, {lo}"};
shr.u32 tb, {wa}, {hi};
{"mov.b32 tc, " + wb if h == 0 else f"shr.u32 tc, {wb}, {lo}"};
shr.u32 td, {wb}, {hi};
lop3.b32 a0, ta, 0x000f000f, {magic}, 0xea;
lop3.b32 a1, tc, 0x000f000f, {magic}, 0xea;
lop3.b32 a2, tb, 0x000f000f, {magic}, 0xea;
lop3.b32 a3, td, 0x000f000f, {magic}, 0xea;
{mma} {{{d}0, {d}1, {d}2, {d}3}}, {{a0, a1, a2, a3}}, {{b0, b1}}, {{{d}0, {d}1, {d}2, {d}3}};
""")
    if ty == "bf16":  # a bf16's bits are a float32's high half
        def halves(src, lo, hi):
            return f"shl.b32 {lo}, {src}, 16;\nand.b32 {hi}, {src}, 0xffff0000;\n"
    else:
        def halves(src, lo, hi):
            return f"mov.b32 {{h0, h1}}, {src};\ncvt.f32.f16 {lo}, h0;\ncvt.f32.f16 {hi}, h1;\n"
    offset = "0f43000000" if ty == "bf16" else "0f44800000"  # 128, 1024
    regs = [f"d{tile}_{u}" for tile in range(tiles) for u in range(4)] + ["e0", "e1", "e2", "e3"]
    tail = []
    for tile in range(tiles):
        d, acc = f"d{tile}_", acc0 + 4 * tile
        if symmetric:
            zeros = f"mov.f32 zg, {'0f43080000' if ty == 'bf16' else '0f44810000'};\nmov.f32 zg8, zg;\n"  # magic + 8
        else:
            zeros = (halves(f"${zero0 + 4 * tile}", "zg", "zg8")
                     + f"add.f32 zg, zg, {offset};\nadd.f32 zg8, zg8, {offset};\n")
        tail.append(halves(f"${scale0 + 4 * tile}", "sg", "sg8") + zeros + "neg.f32 zg, zg;\nneg.f32 zg8, zg8;\n")
        for u in range(4):
            z, sc = ("zg", "sg") if u < 2 else ("zg8", "sg8")
            tail.append(f"fma.rn.f32 {d}{u}, {z}, e{u}, {d}{u};\nmov.b32 c, ${acc + u};\n"
                        f"fma.rn.f32 c, {d}{u}, {sc}, c;\nmov.b32 ${4 * tile + u}, c;\n")
    clear = "".join(f"mov.f32 {r}, 0f00000000;\n" for r in regs)
    return f"""{{
.reg .b32 ta, tb, tc, td, a0, a1, a2, a3, b0, b1, one;
.reg .b16 h0, h1;
.reg .f32 {", ".join(regs)}, sg, sg8, zg, zg8, c;
mov.b32 one, {one};
{clear}{"".join(body)}{"".join(tail)}}}"""


def _operands(tiles: int) -> str:
    return ",".join(["=r"] * (4 * tiles) + ["r"] * (20 * tiles + 16))


#: the PTX of one step and its operand constraints, by (x's dtype, symmetric, tiles)
PACKS = {(dtype, sym, tiles): (_pack_asm(ty, sym, tiles), _operands(tiles))
         for dtype, ty in ((torch.bfloat16, "bf16"), (torch.float16, "f16")) for sym in (False, True)
         for tiles in (1, 2)}
# two 16-bit values (a row's and the row 8 below's, at $4 and $8) as one pair, for four elements
_ROW_PAIR = tl.constexpr("""{
.reg .b16 lo, hi;
ld.global.nc.b16 lo, [$4];
ld.global.nc.b16 hi, [$8];
mov.b32 $0, {lo, hi};
mov.b32 $1, $0;
mov.b32 $2, $0;
mov.b32 $3, $0;
}""")
# a lane's x for its four words: 64 bytes, word i's columns c .. c+7 as four pairs into
# $i, $(4 + i), $(8 + i), $(12 + i)
_X_WORDS = tl.constexpr(lane_loads_asm([(16 * i, (i, 4 + i, 8 + i, 12 + i)) for i in range(4)]))


@triton.jit
def _row_pair(ptrs_a, ptrs_b, EMULATE: tl.constexpr):
    """int32 [BLOCK_P, 16]: the 16-bit values at ``ptrs_a`` (low half) and ``ptrs_b`` (high
    half), one address each a row, two loads per four words."""
    if EMULATE:
        lo = tl.load(ptrs_a).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        hi = tl.load(ptrs_b).to(tl.int16, bitcast=True).to(tl.int32)
        return lo | (hi << 16)
    return tl.inline_asm_elementwise(_ROW_PAIR, "=r,=r,=r,=r,l,l,l,l,l,l,l,l",
                                     [ptrs_a.to(tl.int64), ptrs_b.to(tl.int64)], dtype=tl.int32, is_pure=True,
                                     pack=4)


@triton.jit
def _emulated_rows(words, xv, s_pair, z_pair, HIGH: tl.constexpr, SYMMETRIC: tl.constexpr, X_BF16: tl.constexpr):
    """float32 [BLOCK_P, 8]: each tile row's step (``words``, the pairs' low or high half
    for its scale and zero point) against x's eight rows ``xv`` [8, 16, 8], scaled."""
    j = tl.arange(0, 8)
    q = ((words[:, :, None] >> (4 * j)[None, None, :]) & 0xF).to(tl.float32)  # [BLOCK_P, 16, 8]
    if SYMMETRIC:
        v = q - 8.0
    else:
        v = q - x_of(z_pair, HIGH, X_BF16)[:, :, None]
    d = tl.sum(tl.sum(v[:, None, :, :] * xv[None, :, :, :], 3), 2)  # [BLOCK_P, 8 x rows]
    return d * tl.max(x_of(s_pair, HIGH, X_BF16), 1)[:, None]  # the same along a row


@triton.jit
def _emulated_step(words_a, words_b, x_ptr, stride_xm, k0, M, s_pair, z_pair, SYMMETRIC: tl.constexpr,
                   X_BF16: tl.constexpr):
    """What one step adds to the accumulator, in Triton operations on the same tiles: each
    row's 128 weights against every x row, summed, scaled, and placed where the MMA leaves
    it (lane t's slots u = 0..3: rows g, g, g+8, g+8 at x rows 2t, 2t+1, 2t, 2t+1)."""
    c = tl.arange(0, 16)
    j = tl.arange(0, 8)
    col = 8 * c[:, None] + j[None, :]  # [16 words, 8 nibbles]: the row-major format
    xr = tl.arange(0, 8)
    x_rows = tl.where(xr < M, xr, 0)
    xv = tl.load(x_ptr + x_rows[:, None, None] * stride_xm + k0 + col[None, :, :]).to(tl.float32)  # [8, 16, 8]
    sums_a = _emulated_rows(words_a, xv, s_pair, z_pair, False, SYMMETRIC, X_BF16)
    sums_b = _emulated_rows(words_b, xv, s_pair, z_pair, True, SYMMETRIC, X_BF16)
    u = c % 4
    sel = xr[None, :] == (2 * (c // 4) + (u & 1))[:, None]  # [16, 8]
    picked_a = tl.sum(tl.where(sel[None, :, :], sums_a[:, None, :], 0.0), 2)  # [BLOCK_P, 16]
    picked_b = tl.sum(tl.where(sel[None, :, :], sums_b[:, None, :], 0.0), 2)
    return tl.where((u >> 1)[None, :] == 1, picked_b, picked_a)


@triton.jit(do_not_specialize=["M"])
def _int4_mma_kernel(x_ptr, w_ptr, s_ptr, z_ptr, b_ptr, out_ptr, part_ptr, count_ptr,
                     M, N, steps_per_split, K_STEPS, splits, stride_xm, stride_wn, stride_sn, stride_zn, stride_om,
                     GROUP_SHIFT: tl.constexpr, BLOCK_P: tl.constexpr, TILES: tl.constexpr, SYMMETRIC: tl.constexpr,
                     X_BF16: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, USE_PDL: tl.constexpr,
                     EMULATE: tl.constexpr, ROUND: tl.constexpr, UNROLL: tl.constexpr, PACK_ASM: tl.constexpr,
                     PACK_OPERANDS: tl.constexpr):
    split = tl.program_id(1)
    rows_a, rows_b, rows_a2, rows_b2, c = tile_rows(BLOCK_P, TILES)
    w_a, s_a, z_a = _row_ptrs(rows_a, N, w_ptr, s_ptr, z_ptr, stride_wn, stride_sn, stride_zn, BLOCK_P)
    w_b, s_b, z_b = _row_ptrs(rows_b, N, w_ptr, s_ptr, z_ptr, stride_wn, stride_sn, stride_zn, BLOCK_P)
    w_a2, s_a2, z_a2 = _row_ptrs(rows_a2, N, w_ptr, s_ptr, z_ptr, stride_wn, stride_sn, stride_zn, BLOCK_P)
    w_b2, s_b2, z_b2 = _row_ptrs(rows_b2, N, w_ptr, s_ptr, z_ptr, stride_wn, stride_sn, stride_zn, BLOCK_P)
    x_pairs = x_lanes(x_ptr, M, stride_xm, BLOCK_P, 16)  # lane t: columns 32t .. 32t + 31 of a step
    st_begin = split * steps_per_split
    st_end = tl.minimum(st_begin + steps_per_split, K_STEPS)
    if USE_PDL:  # x comes from the kernel before
        pdl.wait()
    acc = tl.zeros([BLOCK_P, 16], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_P, 16], dtype=tl.float32)
    # the words of the next two steps stay in flight while a step computes (.gemv_words);
    # a prefetch past the split's end reads its last step again, never used
    last = st_end - 1
    first = st_begin * 16 + c
    second = tl.minimum(st_begin + 1, last) * 16 + c
    following_a, following_b = tl.load(w_a + first), tl.load(w_b + first)
    after_a, after_b = tl.load(w_a + second), tl.load(w_b + second)
    if TILES == 2:
        following_a2, following_b2 = tl.load(w_a2 + first), tl.load(w_b2 + first)
        after_a2, after_b2 = tl.load(w_a2 + second), tl.load(w_b2 + second)
    else:
        following_a2, following_b2, after_a2, after_b2 = following_a, following_b, after_a, after_b
    for st in tl.range(st_begin, st_end, loop_unroll_factor=UNROLL):
        words_a, words_b, words_a2, words_b2 = following_a, following_b, following_a2, following_b2
        following_a, following_b, following_a2, following_b2 = after_a, after_b, after_a2, after_b2
        ahead = tl.minimum(st + 2, last) * 16 + c
        after_a, after_b = tl.load(w_a + ahead), tl.load(w_b + ahead)
        group = st >> GROUP_SHIFT  # steps are never negative: a shift, not a division
        s_pair = _row_pair(s_a + group, s_b + group, EMULATE)
        z_pair = s_pair if SYMMETRIC else _row_pair(z_a + group, z_b + group, EMULATE)  # symmetric: unread
        if TILES == 2:
            after_a2, after_b2 = tl.load(w_a2 + ahead), tl.load(w_b2 + ahead)
            s_pair2 = _row_pair(s_a2 + group, s_b2 + group, EMULATE)
            z_pair2 = s_pair2 if SYMMETRIC else _row_pair(z_a2 + group, z_b2 + group, EMULATE)
        else:
            after_a2, after_b2, s_pair2, z_pair2 = after_a, after_b, s_pair, z_pair
        if EMULATE:
            acc += _emulated_step(words_a, words_b, x_ptr, stride_xm, st * _STEP, M, s_pair, z_pair, SYMMETRIC, X_BF16)
            if TILES == 2:
                acc2 += _emulated_step(words_a2, words_b2, x_ptr, stride_xm, st * _STEP, M, s_pair2, z_pair2,
                                       SYMMETRIC, X_BF16)
        else:
            step_bytes = tl.zeros([BLOCK_P, 16], tl.int64) + st.to(tl.int64) * (2 * _STEP)
            x0, x1, x2, x3 = lane_words(_X_WORDS, x_pairs, step_bytes)
            if TILES == 2:
                bits, bits2 = tl.inline_asm_elementwise(
                    PACK_ASM, PACK_OPERANDS,
                    [words_a, words_b, words_a2, words_b2, x0, x1, x2, x3, acc.to(tl.int32, bitcast=True),
                     acc2.to(tl.int32, bitcast=True), s_pair, s_pair2, z_pair, z_pair2],
                    dtype=(tl.int32, tl.int32), is_pure=True, pack=4)
                acc2 = bits2.to(tl.float32, bitcast=True)
            else:
                bits = tl.inline_asm_elementwise(PACK_ASM, PACK_OPERANDS,
                                                 [words_a, words_b, x0, x1, x2, x3, acc.to(tl.int32, bitcast=True),
                                                  s_pair, z_pair], dtype=tl.int32, is_pure=True, pack=4)
            acc = bits.to(tl.float32, bitcast=True)
    finish_tiles(acc, acc2, rows_a, rows_b, rows_a2, rows_b2, c, M, N, b_ptr, out_ptr, part_ptr, count_ptr, split,
                 splits, stride_om, TILES, HAS_BIAS, SPLIT_K, ROUND)


@triton.jit
def _row_ptrs(rows, N, w_ptr, s_ptr, z_ptr, stride_wn, stride_sn, stride_zn, BLOCK_P: tl.constexpr):
    """A tile row's words, scales and zero points (scales and zeros as [BLOCK_P, 16] for the
    pair loads); rows past N read row 0, never stored."""
    safe = tl.where(rows < N, rows, 0)[:, None]
    return (w_ptr + safe.to(tl.int64) * stride_wn, tl.broadcast_to(s_ptr + safe * stride_sn, [BLOCK_P, 16]),
            tl.broadcast_to(z_ptr + safe * stride_zn, [BLOCK_P, 16]))


def int4_mma_matmul(x: torch.Tensor, w: qf.Int4Group, bias: torch.Tensor | None = None, *,
                    num_warps: int | None = None, splits: int | None = None, unroll: int = 2,
                    tiles: int | None = None) -> torch.Tensor:
    """``x`` [M <= 8, K] (bf16 or fp16; see :func:`takes`) times ``w``: [M, N] in x's dtype,
    float32 sums rounded once. ``w``'s scales and zero points are in x's dtype (as
    :func:`ninfer_kernels.quant_rows.to_device` leaves them). A warp owns ``tiles`` (1 or 2)
    16-row tiles: two share x's loads, pairs and sums between them."""
    if not takes(x, w):
        raise ValueError("int4_mma_matmul takes 1 to 8 aligned rows of bf16/fp16 x and a 2-D int4 weight with "
                         "groups and K in multiples of 128")
    rows, (n, k) = x.shape[0], w.shape
    warps_for, tiles_for = launch_shape(rows)
    num_warps, tiles = num_warps or warps_for, tiles or tiles_for
    plan = plan_launch(x, n, k, num_warps, tiles, splits, mma_splits, "int4_mma")
    use_pdl = pdl.enabled(x.device)
    scales, zeros = w.scales.to(x.dtype), w.zeros.to(x.dtype)  # no copies where loading left them so
    emulate = x.device.type != "cuda"
    code, operands = PACKS[x.dtype, w.symmetric, tiles]
    out = plan.out
    _int4_mma_kernel[(plan.programs, plan.splits)](
        x, w.qweight, scales, zeros, bias if bias is not None else out, out, plan.parts, plan.counters,
        rows, n, plan.steps_per_split, plan.k_steps, plan.splits, x.stride(0), w.qweight.stride(0), scales.stride(0),
        zeros.stride(0), out.stride(0),
        GROUP_SHIFT=(w.group_size // STEP).bit_length() - 1, BLOCK_P=8 * num_warps, TILES=tiles, SYMMETRIC=w.symmetric,
        X_BF16=x.dtype == torch.bfloat16, HAS_BIAS=bias is not None, SPLIT_K=plan.splits > 1, USE_PDL=use_pdl,
        EMULATE=emulate, ROUND=emulate and x.dtype == torch.bfloat16, UNROLL=1 if emulate else unroll,
        PACK_ASM=code, PACK_OPERANDS=operands, num_warps=num_warps, num_stages=1, **pdl.launch_options(use_pdl),
    )
    return out
