"""FP8 (e4m3) weights times up to eight rows of x on the tensor cores (``mma.sync``
m16n8k16 in fp16), straight from the row-major :class:`~ninfer_kernels.quant_formats.Fp8Block`
bytes, x kept at its own precision.

Why: at one row the FP8 products ran at 52-74% of copy bandwidth on the H200 (session 24),
on the 16-row ``tl.dot`` tile that pads x to 16 rows and stages both operands through
shared memory, or on the CUDA-core word step (:mod:`.fp8_gemv`). #22 wants the 27B's FP8
step at 1.7x bf16, about 80% of copy bandwidth. Here a weight word goes from the load to
the MMA in two instructions: ``cvt.rn.f16x2.e4m3x2`` turns each half of it (two e4m3
values) into an fp16 pair, exactly (every e4m3 value is an fp16 one), and those pairs are
the MMA's A registers as they are. Nothing passes through shared memory, and a warp's 16
rows read a whole 128-byte line of each row a step. Measured on an H100 (session 28) it
runs 0.93-1.06x the table's word step and is opt-in (:func:`enabled`): both kernels wait
on their loads most of the time, so fewer instructions a word buy nothing there. The
H200, whose table takes the 16-row tile at one row, has not run it yet.

**x in fp16.** fp16 has more mantissa than bf16 but far less range, so a bf16 x is scaled
by a power of two per row and step (its 128 columns' largest magnitude brought under
2^15) before the conversion: exact for every value within 2^-29 of that largest one, and
the power of two comes off the step's sums with the weight's block scale. fp16 x goes in
as it is. Products are exact and summed in float32, as in the weight-only tile, so this
is weight-only FP8: x is not quantized (the dynamic activation quantization the
checkpoints allow is for prefill, where the FP8 tensor cores pay; see :mod:`.quant_gemm`).

**Fragments** (:mod:`.mma_rows`). A step is 128 columns: a row's 32 words, lane ``t``
reading words ``4t .. 4t + 3`` (columns ``16t ..``) and ``16 + 4t ..`` (columns ``64 +
16t ..``) of rows ``g`` and ``g + 8``, eight MMAs. Word ``i`` of a half holds columns
``c .. c + 3``: its low fp16 pair goes to positions ``2t, 2t + 1`` of its MMA, its high
pair to ``2t + 8, 2t + 9``, and B takes x's pairs ``(c, c + 1)`` and ``(c + 2, c + 3)``,
which lane ``(g, t)`` loads for x row ``g`` as 64 bytes: its columns of the two halves.

A block scale is one number per ``bn`` rows and ``bk`` columns (``bk`` a multiple of
128, or all of K): each step's sums take the scale of their row and the x row's power of
two once, with no loop over K inside a step. Under the interpreter (``EMULATE``) the
step's sums come from Triton operations on the same tiles (e4m3 decoded by arithmetic),
so CPU tests check addressing, splits, scales and where each output lands.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ninfer_kernels import quant_formats as qf
from ninfer_kernels.triton import pdl
from ninfer_kernels.triton.fp8_gemv import _e4m3
from ninfer_kernels.triton.mma_rows import (
    MMA_ROWS, STEP, finish_tiles, lane_loads_asm, lane_words, plan_launch, tile_rows, x_lanes,
)

_STEP = tl.constexpr(STEP)
_X_DTYPES = (torch.bfloat16, torch.float16)
#: a block scale over all of K: the step's group index shifted to nothing
_ONE_GROUP = 30


def enabled() -> bool:
    """``NINFER_FP8_MMA=1`` sends every FP8 product of one to eight rows here (read per
    call); otherwise only table entries routed ``mma`` do. On an H100 (session 28) the
    table's word step was about as fast (this kernel 0.93-1.06x at the 27B's projections,
    0.94x in the whole c=1 step)."""
    return os.environ.get("NINFER_FP8_MMA", "0") == "1"


def launch_shape(rows: int) -> tuple[int, int]:
    """(warps, tiles a warp): 4 warps of one tile were best, or within 1%, at all ten of
    the 27B's projection-and-row cases on an H100 (session 28, one and eight rows)."""
    return 4, 1


#: programs of 4 warps an SM holds at once (80-91 registers a thread: the register file's
#: limit). K parts fill that many and no more: the H100 sweep's best split counts did
#: (session 28), and one more wave (768 programs for 660 places at 16384 x 5120) cost 14%
RESIDENT = 5


def fp8_splits(n: int, k: int, num_warps: int, sms: int, tiles: int) -> int:
    """K parts that fill the SMs' resident programs in one wave, each at least four steps."""
    programs = triton.cdiv(n, 16 * tiles * num_warps)
    return max(1, min(RESIDENT * sms // programs, k // STEP // 4))


def takes(x: torch.Tensor, w: qf.Fp8Block) -> bool:
    """Whether :func:`fp8_mma_matmul` serves ``x`` times ``w``: one to eight rows of bf16 or
    fp16 x (rows 16-byte aligned), a 2-D e4m3 weight with K a multiple of 128 (rows 16-byte
    aligned, which Triton's divisibility hint must see for the 16-byte loads the fragments
    rely on) and scale groups of 128 columns times a power of two, or all of K."""
    bn, bk = w.block
    k = w.shape[-1]
    groups = bk // STEP
    return (x.dim() == 2 and 0 < x.shape[0] <= MMA_ROWS and x.dtype in _X_DTYPES and w.weight.dim() == 2
            and w.weight.dtype == torch.float8_e4m3fn and k % STEP == 0 and x.shape[1] == k
            and bk % STEP == 0 and (bk >= k or groups & (groups - 1) == 0) and bn >= 1
            and x.stride(1) == 1 and (x.shape[0] == 1 or x.stride(0) % 8 == 0) and x.data_ptr() % 16 == 0
            and w.weight.stride(1) == 1 and w.weight.stride(0) % 64 == 0 and w.weight.data_ptr() % 16 == 0
            and w.scale.dim() == 2 and w.scale.dtype == torch.float32)


def _step_asm(tiles: int) -> str:
    """PTX for one step of a lane: for each of ``tiles`` 16-row tiles, its 16 words (rows g
    and g + 8, the step's two halves) as eight MMAs against x's fp16 pairs, then ``acc += D
    * scale(row) * inverse(x row)``. Operands, for T tiles: $0 .. $(4T - 1) the new
    accumulators (float32 bits, slot u of tile j at 4j + u); from W = 4T tile j's words at
    W + 16j: row g's first half, its second, row g + 8's first, its second (four each); from
    X = 20T x's 16 fp16 pairs in column order; X + 16 the x rows' inverse powers of two
    (2t, 2t + 1, 2t, 2t + 1); from A = X + 20 the accumulators; from A + 4T each tile's row
    scales (g, g, g + 8, g + 8)."""
    w0, x0 = 4 * tiles, 20 * tiles
    inv0, acc0 = x0 + 16, x0 + 20
    scale0 = acc0 + 4 * tiles
    mma = "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32"
    body = []
    for half in range(2):
        for i in range(4):
            b0, b1 = f"${x0 + 8 * half + 2 * i}", f"${x0 + 8 * half + 2 * i + 1}"
            for tile in range(tiles):
                wa, wb, d = f"${w0 + 16 * tile + 4 * half + i}", f"${w0 + 16 * tile + 8 + 4 * half + i}", f"d{tile}_"
                body.append(f"""mov.b32 {{la, ha}}, {wa};
mov.b32 {{lb, hb}}, {wb};
cvt.rn.f16x2.e4m3x2 a0, la;
cvt.rn.f16x2.e4m3x2 a1, lb;
cvt.rn.f16x2.e4m3x2 a2, ha;
cvt.rn.f16x2.e4m3x2 a3, hb;
{mma} {{{d}0, {d}1, {d}2, {d}3}}, {{a0, a1, a2, a3}}, {{{b0}, {b1}}}, {{{d}0, {d}1, {d}2, {d}3}};
""")
    regs = [f"d{tile}_{u}" for tile in range(tiles) for u in range(4)]
    tail = []
    for tile in range(tiles):
        for u in range(4):
            slot = 4 * tile + u
            tail.append(f"mul.f32 f, ${scale0 + slot}, ${inv0 + (u & 1)};\nmov.b32 c, ${acc0 + slot};\n"
                        f"fma.rn.f32 c, d{tile}_{u}, f, c;\nmov.b32 ${slot}, c;\n")
    clear = "".join(f"mov.f32 {r}, 0f00000000;\n" for r in regs)
    return f"""{{
.reg .b32 a0, a1, a2, a3;
.reg .b16 la, ha, lb, hb;
.reg .f32 {", ".join(regs)}, f, c;
{clear}{"".join(body)}{"".join(tail)}}}"""


def _operands(tiles: int) -> str:
    return ",".join(["=r"] * (4 * tiles) + ["r"] * (24 * tiles + 20))


#: the PTX of one step and its operand constraints, by tiles a warp
STEPS = {tiles: (_step_asm(tiles), _operands(tiles)) for tiles in (1, 2)}


def _x_halves_asm() -> str:
    """PTX making a lane's 16 bf16 pairs of x ($20 .. $35) into fp16 pairs ($0 .. $15): the
    largest magnitude of the row's 128 columns (the four lanes of a row), a power of two
    2^(k - 127) that brings it under 2^15, the pairs scaled by it and converted; $16 .. $19
    the inverse powers of the x rows this lane's sums belong to (2t, 2t + 1, twice),
    fetched from the lanes that hold those rows."""
    lines = ["and.b32 m, $20, 0x7fff7fff;"]
    for j in range(1, 16):
        lines.append(f"and.b32 t0, ${20 + j}, 0x7fff7fff;\nmax.u16x2 m, m, t0;")
    lines.append("""shr.b32 t0, m, 16;
and.b32 m, m, 0xffff;
max.u32 m, m, t0;
shfl.sync.bfly.b32 t0, m, 1, 0x1f, 0xffffffff;
max.u32 m, m, t0;
shfl.sync.bfly.b32 t0, m, 2, 0x1f, 0xffffffff;
max.u32 m, m, t0;
shr.u32 e, m, 7;
sub.s32 k, 268, e;
max.s32 k, k, 1;
min.s32 k, k, 253;
shl.b32 sc, k, 23;
sub.s32 t0, 254, k;
shl.b32 inv, t0, 23;
mov.u32 lane, %laneid;
and.b32 src, lane, 3;
shl.b32 src, src, 3;
shfl.sync.idx.b32 $16, inv, src, 0x1f, 0xffffffff;
add.u32 src, src, 4;
shfl.sync.idx.b32 $17, inv, src, 0x1f, 0xffffffff;
mov.b32 $18, $16;
mov.b32 $19, $17;""")
    for j in range(16):
        lines.append(f"""shl.b32 t0, ${20 + j}, 16;
and.b32 t1, ${20 + j}, 0xffff0000;
mul.f32 f0, t0, sc;
mul.f32 f1, t1, sc;
cvt.rn.f16x2.f32 ${j}, f1, f0;""")
    return "{\n.reg .b32 m, t0, t1, e, k, sc, inv, lane, src;\n.reg .f32 f0, f1;\n" + "\n".join(lines) + "\n}"


#: the PTX of :func:`_x_halves_asm`, a kernel argument (strings must reach the kernel as constexprs)
X_HALVES = _x_halves_asm()
_X_OPERANDS = tl.constexpr(",".join(["=r"] * 20 + ["r"] * 16))
# a lane's 16 pairs of x for a step in column order: 32 bytes (columns 16t ..) and 32 from
# 128 bytes on (columns 64 + 16t ..)
_X_PAIRS = tl.constexpr(lane_loads_asm([(off, tuple(range(4 * j, 4 * j + 4)))
                                        for j, off in enumerate((0, 16, 128, 144))]))


@triton.jit
def _row_scales(ptrs_a, ptrs_b):
    """float32 [BLOCK_P, 16]: the scales at ``ptrs_a`` (rows g: slots 0, 1) and ``ptrs_b``
    (rows g + 8: slots 2, 3), ``[BLOCK_P, 1]`` pointers each. Plain loads and a select by
    position, not PTX: an inline-asm load that wrote slots by their place in a lane's pack
    gave rows g + 8 the scales of rows g on the GPU (session 28), because Triton folded the
    pointers to one column and the pack no longer held a lane's four slots."""
    u = tl.arange(0, 16)[None, :] % 4
    return tl.where(u < 2, tl.load(ptrs_a), tl.load(ptrs_b))


@triton.jit
def _emulated_rows(lo, hi, x_lo, x_hi):
    """float32 [BLOCK_P, 8]: each tile row's 128 weights (its step's two halves, 16 words
    each) against x's eight rows (``x_lo``, ``x_hi`` [8, 16, 4]: the same columns)."""
    j = tl.arange(0, 4)
    v_lo = _e4m3(lo[:, :, None] >> (8 * j)[None, None, :])  # [BLOCK_P, 16, 4]
    v_hi = _e4m3(hi[:, :, None] >> (8 * j)[None, None, :])
    d = tl.sum(tl.sum(v_lo[:, None, :, :] * x_lo[None, :, :, :], 3), 2)
    return d + tl.sum(tl.sum(v_hi[:, None, :, :] * x_hi[None, :, :, :], 3), 2)


@triton.jit
def _emulated_step(lo_a, hi_a, lo_b, hi_b, x_ptr, stride_xm, k0, M, scales):
    """What one step adds, in Triton operations on the same tiles, placed where the MMA
    leaves it (lane t's slots u = 0..3: rows g, g, g+8, g+8 at x rows 2t, 2t+1, 2t, 2t+1)
    and scaled by the row's scale (x is exact in float32: no power of two to undo)."""
    c = tl.arange(0, 16)
    xr = tl.arange(0, 8)
    x_rows = tl.where(xr < M, xr, 0)
    col = 4 * c[:, None] + tl.arange(0, 4)[None, :]  # [16 words, 4 bytes]: the row-major format
    x_first = x_ptr + x_rows[:, None, None] * stride_xm + k0 + col[None, :, :]
    x_lo = tl.load(x_first).to(tl.float32)  # [8, 16, 4]
    x_hi = tl.load(x_first + 64).to(tl.float32)
    sums_a = _emulated_rows(lo_a, hi_a, x_lo, x_hi)
    sums_b = _emulated_rows(lo_b, hi_b, x_lo, x_hi)
    u = c % 4
    sel = xr[None, :] == (2 * (c // 4) + (u & 1))[:, None]  # [16, 8]
    picked_a = tl.sum(tl.where(sel[None, :, :], sums_a[:, None, :], 0.0), 2)  # [BLOCK_P, 16]
    picked_b = tl.sum(tl.where(sel[None, :, :], sums_b[:, None, :], 0.0), 2)
    return tl.where((u >> 1)[None, :] == 1, picked_b, picked_a) * scales


@triton.jit
def _tile_words(w_a, w_b, st, c):
    """A tile's words of step ``st``: rows g and g + 8, each step's two halves."""
    first, second = st * 32 + c, st * 32 + 16 + c
    return tl.load(w_a + first), tl.load(w_a + second), tl.load(w_b + first), tl.load(w_b + second)


@triton.jit
def _step_x(lanes, st, EMULATE: tl.constexpr, BLOCK_P: tl.constexpr):
    """A lane's raw x pairs for step ``st`` (four int32 [BLOCK_P, 16]; zeros when emulated)."""
    if EMULATE:
        z = tl.zeros([BLOCK_P, 16], tl.int32)
        return z, z, z, z
    return lane_words(_X_PAIRS, lanes, tl.zeros([BLOCK_P, 16], tl.int64) + st.to(tl.int64) * (2 * _STEP))


@triton.jit(do_not_specialize=["M"])
def _fp8_mma_kernel(x_ptr, w_ptr, s_ptr, b_ptr, out_ptr, part_ptr, count_ptr,
                    M, N, steps_per_split, K_STEPS, splits, stride_xm, stride_wn, stride_sn, stride_sk, stride_om,
                    BN, GROUP_SHIFT: tl.constexpr, BLOCK_P: tl.constexpr, TILES: tl.constexpr, X_BF16: tl.constexpr,
                    HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, USE_PDL: tl.constexpr, EMULATE: tl.constexpr,
                    ROUND: tl.constexpr, STEP_ASM: tl.constexpr, STEP_OPERANDS: tl.constexpr,
                    X_ASM: tl.constexpr):
    split = tl.program_id(1)
    rows_a, rows_b, rows_a2, rows_b2, c = tile_rows(BLOCK_P, TILES)
    w_a, s_a = _row_ptrs(rows_a, N, BN, w_ptr, s_ptr, stride_wn, stride_sn)
    w_b, s_b = _row_ptrs(rows_b, N, BN, w_ptr, s_ptr, stride_wn, stride_sn)
    w_a2, s_a2 = _row_ptrs(rows_a2, N, BN, w_ptr, s_ptr, stride_wn, stride_sn)
    w_b2, s_b2 = _row_ptrs(rows_b2, N, BN, w_ptr, s_ptr, stride_wn, stride_sn)
    x_pairs = x_lanes(x_ptr, M, stride_xm, BLOCK_P, 8)  # lane t: columns 16t .. 16t + 15 of each half
    st_begin = split * steps_per_split
    st_end = tl.minimum(st_begin + steps_per_split, K_STEPS)
    last = st_end - 1
    # the words of the next two steps stay in flight while a step computes (.gemv_words);
    # a prefetch past the split's end reads its last step again, never used
    f_la, f_ha, f_lb, f_hb = _tile_words(w_a, w_b, st_begin, c)
    n_la, n_ha, n_lb, n_hb = _tile_words(w_a, w_b, tl.minimum(st_begin + 1, last), c)
    if TILES == 2:
        f2_la, f2_ha, f2_lb, f2_hb = _tile_words(w_a2, w_b2, st_begin, c)
        n2_la, n2_ha, n2_lb, n2_hb = _tile_words(w_a2, w_b2, tl.minimum(st_begin + 1, last), c)
    else:
        f2_la, f2_ha, f2_lb, f2_hb, n2_la, n2_ha, n2_lb, n2_hb = f_la, f_ha, f_lb, f_hb, n_la, n_ha, n_lb, n_hb
    if USE_PDL:  # x comes from the kernel before
        pdl.wait()
    # x and the block scales a step ahead too (in the step, their loads would stall every warp)
    nx0, nx1, nx2, nx3 = _step_x(x_pairs, st_begin, EMULATE, BLOCK_P)
    group = (st_begin >> GROUP_SHIFT) * stride_sk  # steps are never negative: a shift, not a division
    n_scales = _row_scales(s_a + group, s_b + group)
    n_scales2 = _row_scales(s_a2 + group, s_b2 + group) if TILES == 2 else n_scales
    acc = tl.zeros([BLOCK_P, 16], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_P, 16], dtype=tl.float32)
    for st in tl.range(st_begin, st_end):
        la, ha, lb, hb, la2, ha2, lb2, hb2 = f_la, f_ha, f_lb, f_hb, f2_la, f2_ha, f2_lb, f2_hb
        f_la, f_ha, f_lb, f_hb, f2_la, f2_ha, f2_lb, f2_hb = n_la, n_ha, n_lb, n_hb, n2_la, n2_ha, n2_lb, n2_hb
        ahead = tl.minimum(st + 2, last)
        n_la, n_ha, n_lb, n_hb = _tile_words(w_a, w_b, ahead, c)
        x0, x1, x2, x3, scales, scales2 = nx0, nx1, nx2, nx3, n_scales, n_scales2
        nxt = tl.minimum(st + 1, last)
        nx0, nx1, nx2, nx3 = _step_x(x_pairs, nxt, EMULATE, BLOCK_P)
        group = (nxt >> GROUP_SHIFT) * stride_sk
        n_scales = _row_scales(s_a + group, s_b + group)
        if TILES == 2:
            n2_la, n2_ha, n2_lb, n2_hb = _tile_words(w_a2, w_b2, ahead, c)
            n_scales2 = _row_scales(s_a2 + group, s_b2 + group)
        else:
            n2_la, n2_ha, n2_lb, n2_hb, n_scales2 = n_la, n_ha, n_lb, n_hb, n_scales
        if EMULATE:
            acc += _emulated_step(la, ha, lb, hb, x_ptr, stride_xm, st * _STEP, M, scales)
            if TILES == 2:
                acc2 += _emulated_step(la2, ha2, lb2, hb2, x_ptr, stride_xm, st * _STEP, M, scales2)
        else:
            if X_BF16:
                h0, h1, h2, h3, inv = tl.inline_asm_elementwise(
                    X_ASM, _X_OPERANDS,
                    [x0, x1, x2, x3], dtype=(tl.int32, tl.int32, tl.int32, tl.int32, tl.int32), is_pure=True, pack=4)
            else:  # fp16 x goes in as it is
                h0, h1, h2, h3 = x0, x1, x2, x3
                inv = tl.full([BLOCK_P, 16], 0x3F800000, tl.int32)  # 1.0
            if TILES == 2:
                bits, bits2 = tl.inline_asm_elementwise(
                    STEP_ASM, STEP_OPERANDS,
                    [la, ha, lb, hb, la2, ha2, lb2, hb2, h0, h1, h2, h3, inv, acc.to(tl.int32, bitcast=True),
                     acc2.to(tl.int32, bitcast=True), scales.to(tl.int32, bitcast=True),
                     scales2.to(tl.int32, bitcast=True)],
                    dtype=(tl.int32, tl.int32), is_pure=True, pack=4)
                acc2 = bits2.to(tl.float32, bitcast=True)
            else:
                bits = tl.inline_asm_elementwise(
                    STEP_ASM, STEP_OPERANDS,
                    [la, ha, lb, hb, h0, h1, h2, h3, inv, acc.to(tl.int32, bitcast=True),
                     scales.to(tl.int32, bitcast=True)], dtype=tl.int32, is_pure=True, pack=4)
            acc = bits.to(tl.float32, bitcast=True)
    finish_tiles(acc, acc2, rows_a, rows_b, rows_a2, rows_b2, c, M, N, b_ptr, out_ptr, part_ptr, count_ptr, split,
                 splits, stride_om, TILES, HAS_BIAS, SPLIT_K, ROUND)


@triton.jit
def _row_ptrs(rows, N, BN, w_ptr, s_ptr, stride_wn, stride_sn):
    """A tile row's words and its block-row of scales ([BLOCK_P, 1]); rows past N read row
    0, never stored."""
    safe = tl.where(rows < N, rows, 0)[:, None]
    return w_ptr + safe.to(tl.int64) * stride_wn, s_ptr + (safe // BN) * stride_sn


def fp8_mma_matmul(x: torch.Tensor, w: qf.Fp8Block, bias: torch.Tensor | None = None, *,
                   num_warps: int | None = None, splits: int | None = None,
                   tiles: int | None = None) -> torch.Tensor:
    """``x`` [M <= 8, K] (bf16 or fp16; see :func:`takes`) times ``w``: [M, N] in x's dtype,
    float32 sums rounded once. A warp owns ``tiles`` (1 or 2) 16-row tiles: two share x's
    loads and conversion. The K loop is not unrolled: unrolled twice, Triton 3.6 held the
    next step's loads in 173 registers a thread instead of 80 (one program an SM instead of
    three), and the int4 kernel's loop with values carried a step ahead gave wrong sums
    when unrolled over an odd number of steps (session 28)."""
    if not takes(x, w):
        raise ValueError("fp8_mma_matmul takes 1 to 8 aligned rows of bf16/fp16 x and a 2-D e4m3 weight with K a "
                         "multiple of 128 and scale groups of 128 times a power of two (or all of K)")
    rows, (n, k) = x.shape[0], w.shape
    bn, bk = w.block
    warps_for, tiles_for = launch_shape(rows)
    num_warps, tiles = num_warps or warps_for, tiles or tiles_for
    plan = plan_launch(x, n, k, num_warps, tiles, splits, fp8_splits, "fp8_mma")
    out = plan.out
    use_pdl = pdl.enabled(x.device)
    emulate = x.device.type != "cuda"
    words = w.weight.view(torch.int32)
    code, operands = STEPS[tiles]
    _fp8_mma_kernel[(plan.programs, plan.splits)](
        x, words, w.scale, bias if bias is not None else out, out, plan.parts, plan.counters,
        rows, n, plan.steps_per_split, plan.k_steps, plan.splits, x.stride(0), words.stride(0), w.scale.stride(0),
        w.scale.stride(1), out.stride(0), bn,
        GROUP_SHIFT=_ONE_GROUP if bk >= k else (bk // STEP).bit_length() - 1, BLOCK_P=8 * num_warps, TILES=tiles,
        X_BF16=x.dtype == torch.bfloat16, HAS_BIAS=bias is not None, SPLIT_K=plan.splits > 1, USE_PDL=use_pdl,
        EMULATE=emulate, ROUND=emulate and x.dtype == torch.bfloat16, STEP_ASM=code, STEP_OPERANDS=operands,
        X_ASM=X_HALVES, num_warps=num_warps, num_stages=1,
        **pdl.launch_options(use_pdl),
    )
    return out
