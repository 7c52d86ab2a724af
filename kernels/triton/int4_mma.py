"""int4 weights times up to eight rows of x on the tensor cores (``mma.sync`` m16n8k16),
from a layout made for it once at load time (:func:`mma_layout`).

Why: the packed one-row step (:mod:`.int4_fp16`) multiplies on the CUDA cores, about 25
sm_90 instructions a 32-bit weight word (eight weights) for nibbles, zero points, x's fp16
pairs, eight products and their fp32 sum. A Hopper SM streams 3.5 (H100) to 4.6 (H200)
such words a cycle from HBM and issues 128 thread-instructions a cycle, so that step
cannot keep up with the memory on the H200 and barely on the H100 (38-63% of copy
bandwidth). Here a word is one thread's whole share of one MMA: three shifts and four
``lop3`` make its eight weights, and one ``mma.sync`` per warp multiplies 32 such words
by x (about 12 instructions a word in all). Marlin (IST-DASLab) showed the approach; this
is our own layout and code.

The weights enter the MMA as ``128 + q`` (bf16; ``1024 + q`` in fp16), exact, with no
subtraction: ``sum (q - z) x = sum (128 + q) x - (128 + z) sum x``, and ``sum x`` comes
from a second MMA of the same x with an A of ones. Both sums gather a whole call (one
or two steps of a scale group) in float32 before the group's zero point and scale apply
once: 1 MMA more a word instead of 4 subtractions. Products are exact, and float32 keeps
``(128 + z) sum x`` exact enough to subtract: with |x| up to 1e3 the difference is off by
about 1e-5 of itself.

The MMA's A operand is 16 weight rows by 16 columns and B is 16 columns by 8 rows of x,
so up to eight rows of x cost the same instructions as one. Lane ``l`` of a warp holds A's
rows ``g = l // 4`` and ``g + 8`` at columns ``2t, 2t + 1, 2t + 8, 2t + 9`` (``t = l % 4``),
B's column ``g`` at those columns, and gets D's rows ``g, g + 8`` at x rows ``2t, 2t + 1``.

Layout (:func:`mma_layout`): physical row ``P = 8 T + g`` holds logical rows
``16 T + g`` and ``16 T + g + 8``. A K step is 64 columns, 16 words a physical row: word
``c = 4 t + i`` is what lane ``(g, t)`` feeds its ``i``-th MMA of the step. Its nibble ``j``
is row ``16 T + g + 8 (j & 1)``, x pair ``p = 8 t + 2 i + ((j >> 1) & 1)`` of the step,
column ``2 p + (j >> 2)``. So ``lop3(word >> 4 s, 0x000f000f, 0x43004300)`` for s = 0..3 are
the lane's four A registers as bf16 pairs ``128 + q`` (nibbles ``s`` and ``s + 4``), and a
lane's x for its four words are pairs ``8 t .. 8 t + 7`` of the step, each word's B
registers side by side: two 16-byte loads land them where the MMAs read them, with no
conversion (x stays bf16 or fp16; the MMA takes either) and no register moves.
Which K column goes with which MMA position is free (a sum does not care) as long as
weight and x agree: the layout picks the one that makes x's loads whole. (A 32-word step
would not do: Triton lays a 32-column tile out eight threads wide, not four.)

Each group's scales (and zero points) are one 32-bit pair a physical row: rows
``16 T + g`` and ``16 T + g + 8`` in the low and high halves, in x's dtype (the dtype the
loaded scales already have). Zero points are stored as ``128 + z`` (bf16) or ``1024 + z``
(fp16), exact; a symmetric weight has none (8 is a constant).

The kernel relies on Triton giving a ``[BLOCK_P, 16]`` int32 tile loaded 16 bytes a
thread the blocked layout ``sizePerThread [1, 4]``, ``threadsPerWarp [8, 4]``,
``warpsPerCTA [num_warps, 1]`` (lane ``l`` holds row ``l // 4`` of its warp's eight,
words ``4 (l % 4)`` onward), and ``pack=4`` handing one inline-asm call those four words:
``scripts/triton_ir.py`` shows the layout, and the GPU tests compare with the reference. Under the interpreter (``EMULATE``) the same sums are made with Triton
operations from the same layout, so CPU tests check the packing, addressing and splits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ninfer_kernels import quant_formats as qf
from ninfer_kernels.triton import pdl
from ninfer_kernels.triton.counters import counter_buffer
from ninfer_kernels.triton.rounding import round_to

#: rows of x one launch covers (the MMA's n)
MMA_ROWS = 8
#: K columns a step (16 words a physical row)
STEP = 64
_STEP = tl.constexpr(STEP)
#: x's dtype -> (the exponent bits that make a nibble q the float magic + q, magic)
_MAGIC = {torch.bfloat16: (0x4300, 128.0), torch.float16: (0x6400, 1024.0)}


@dataclass
class Int4Mma:
    """An :class:`~ninfer_kernels.quant_formats.Int4Group` weight in the MMA layout (module
    docstring): ``words`` int32 ``[ceil(N / 16) * 8, K // 4]``, ``scales`` int32 pairs
    ``[ceil(N / 16) * 8, K // group_size]``, ``zeros`` likewise (``magic + z``) or None
    (symmetric), all for x of ``dtype``."""

    words: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None
    n: int
    k: int
    group_size: int
    dtype: torch.dtype


def serves(w: qf.Int4Group, dtype: torch.dtype) -> bool:
    """Whether :func:`mma_layout` takes ``w`` for x of ``dtype``."""
    steps = w.group_size // STEP  # a group's steps: a power of two, so a step's group is a shift
    return (w.qweight.dim() == 2 and dtype in _MAGIC and w.group_size % STEP == 0 and steps & (steps - 1) == 0
            and w.shape[-1] % STEP == 0)


def _pairs(lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """int32 words with 16-bit ``lo`` in the low half and ``hi`` in the high half."""
    lo16 = lo.contiguous().view(torch.int16).to(torch.int32) & 0xFFFF
    hi16 = hi.contiguous().view(torch.int16).to(torch.int32)
    return lo16 | (hi16 << 16)


def _block_pattern(device: torch.device) -> torch.Tensor:
    """Where each (physical row g, word c, nibble j) of a 16-row, 64-column block comes from
    in the block (row-major): row ``g + 8 (j & 1)``, column ``2 pair + (j >> 2)``."""
    g = torch.arange(8, device=device).view(-1, 1, 1)
    c = torch.arange(16, device=device).view(1, -1, 1)
    j = torch.arange(8, device=device).view(1, 1, -1)
    pair = 8 * (c // 4) + 2 * (c % 4) + ((j >> 1) & 1)
    return ((g + 8 * (j & 1)) * STEP + 2 * pair + (j >> 2)).flatten()


def mma_layout(w: qf.Int4Group, dtype: torch.dtype) -> Int4Mma:
    """``w`` (2-D) in the MMA layout for x of ``dtype`` (bf16 or fp16). Rows past N are
    padded with zero weights and scales."""
    if not serves(w, dtype):
        raise ValueError(f"the int4 MMA layout takes a 2-D weight with K a multiple of {STEP} and groups of {STEP} "
                         f"times a power of two, "
                         f"and bf16 or fp16 x (got {tuple(w.shape)}, group {w.group_size}, {dtype})")
    n, k = w.shape
    dev = w.qweight.device
    n16 = -(-n // 16) * 16
    shifts = torch.arange(0, 32, 4, device=dev, dtype=torch.int32)
    q = ((w.qweight.unsqueeze(-1) >> shifts) & 0xF).flatten(-2).to(torch.uint8)  # [N, K]
    q = torch.nn.functional.pad(q, (0, 0, 0, n16 - n))
    p_rows, steps = n16 // 2, k // STEP
    blocks = q.view(n16 // 16, 16, steps, STEP).transpose(1, 2).reshape(n16 // 16, steps, 16 * STEP)
    nibbles = blocks[:, :, _block_pattern(dev)].view(n16 // 16, steps, 8, 16, 8).to(torch.int32)
    packed = nibbles[..., 0]
    for jj in range(1, 8):  # int32 shifts wrap into the sign bit, as the word's top nibble should
        packed = packed | (nibbles[..., jj] << (4 * jj))
    packed = packed.permute(0, 2, 1, 3).reshape(p_rows, k // 4)  # physical row 8 T + g, word 16 s + c

    def row_pairs(values: torch.Tensor) -> torch.Tensor:
        v = torch.nn.functional.pad(values.to(dtype), (0, 0, 0, n16 - n)).view(n16 // 16, 2, 8, -1)
        return _pairs(v[:, 0], v[:, 1]).reshape(p_rows, -1).contiguous()

    zeros = None if w.symmetric else row_pairs(_MAGIC[dtype][1] + w.zeros.float())
    return Int4Mma(packed.contiguous(), row_pairs(w.scales), zeros, n, k, w.group_size, dtype)


def _unpair(pairs: torch.Tensor, dtype: torch.dtype, n: int) -> torch.Tensor:
    """:func:`mma_layout`'s row pairs back to ``[N, groups]`` values of ``dtype``."""
    lo = (pairs & 0xFFFF).to(torch.int16).view(dtype)
    hi = (pairs >> 16).to(torch.int16).view(dtype)
    return torch.stack((lo.view(-1, 8, lo.shape[-1]), hi.view(-1, 8, hi.shape[-1])), 1).reshape(-1, lo.shape[-1])[:n]


def int4_group(m: Int4Mma) -> qf.Int4Group:
    """The row-major :class:`~ninfer_kernels.quant_formats.Int4Group` ``m`` was made from
    (what the reference and the cuBLAS prefill route dequantize)."""
    dev, p_rows, steps = m.words.device, m.words.shape[0], m.k // STEP
    shifts = torch.arange(0, 32, 4, device=dev, dtype=torch.int32)
    nibbles = ((m.words.view(p_rows // 8, 8, steps, 16).permute(0, 2, 1, 3).unsqueeze(-1) >> shifts) & 0xF)
    blocks = torch.empty(p_rows // 8, steps, 16 * STEP, dtype=torch.int32, device=dev)
    blocks[:, :, _block_pattern(dev)] = nibbles.reshape(p_rows // 8, steps, -1)
    q = blocks.view(p_rows // 8, steps, 16, STEP).transpose(1, 2).reshape(2 * p_rows, m.k)[:m.n]
    words = q.view(m.n, m.k // 8, 8) << shifts
    qweight = words[..., 0]
    for jj in range(1, 8):
        qweight = qweight | words[..., jj]
    scales = _unpair(m.scales, m.dtype, m.n)
    if m.zeros is None:
        return qf.Int4Group(qweight, scales, torch.full_like(scales, 8), m.group_size, symmetric=True)
    return qf.Int4Group(qweight, scales, _unpair(m.zeros, m.dtype, m.n) - _MAGIC[m.dtype][1], m.group_size)


def call_steps(group_size: int, k: int) -> int:
    """Steps one call of the kernel's inner code covers: two (a 128-column group, or two
    steps of a larger one) where the group and K allow, else one."""
    return 2 if group_size % (2 * STEP) == 0 and k % (2 * STEP) == 0 else 1


def _pack_asm(ty: str, steps: int, symmetric: bool) -> str:
    """PTX for one call: a lane's four words of each of ``steps`` steps (one MMA each, into
    D) and their x (into S, against ones), then ``acc += s (D - (magic + z) S)`` for the
    lane's four outputs. Operands: $0..$3 the new accumulator (float32 bits: rows g, g,
    g+8, g+8 at x rows 2t, 2t+1, 2t, 2t+1); then per step the words, x's first pairs and
    x's second pairs (four each); then the accumulator, the scale pairs and the zero
    pairs (only the first of each four read)."""
    magic = "0x43004300" if ty == "bf16" else "0x64006400"
    one = "0x3f803f80" if ty == "bf16" else "0x3c003c00"
    base = 4 + 12 * steps
    acc, scale, zero = base, base + 4, base + 8
    body = []
    for st in range(steps):
        for n in range(4):
            w, xa, xb = f"${4 + 12 * st + n}", f"${8 + 12 * st + n}", f"${12 + 12 * st + n}"
            body.append(f"""shr.u32 t1, {w}, 4;
shr.u32 t2, {w}, 8;
shr.u32 t3, {w}, 12;
lop3.b32 a0, {w}, 0x000f000f, {magic}, 0xea;
lop3.b32 a1, t1, 0x000f000f, {magic}, 0xea;
lop3.b32 a2, t2, 0x000f000f, {magic}, 0xea;
lop3.b32 a3, t3, 0x000f000f, {magic}, 0xea;
mma.sync.aligned.m16n8k16.row.col.f32.{ty}.{ty}.f32 {{d0, d1, d2, d3}}, {{a0, a1, a2, a3}}, {{{xa}, {xb}}}, {{d0, d1, d2, d3}};
mma.sync.aligned.m16n8k16.row.col.f32.{ty}.{ty}.f32 {{e0, e1, e2, e3}}, {{one, one, one, one}}, {{{xa}, {xb}}}, {{e0, e1, e2, e3}};
""")
    if ty == "bf16":  # a bf16's bits are a float32's high half
        halves = lambda src, lo, hi: f"shl.b32 {lo}, {src}, 16;\nand.b32 {hi}, {src}, 0xffff0000;\n"  # noqa: E731
    else:
        halves = lambda src, lo, hi: (f"mov.b32 {{h0, h1}}, {src};\ncvt.f32.f16 {lo}, h0;\n"  # noqa: E731
                                      f"cvt.f32.f16 {hi}, h1;\n")
    zeros = (f"mov.f32 zg, {'0f43080000' if ty == 'bf16' else '0f44810000'};\nmov.f32 zg8, zg;\n" if symmetric
             else halves(f"${zero}", "zg", "zg8"))
    clear = "".join(f"mov.f32 {r}, 0f00000000;\n" for r in ("d0", "d1", "d2", "d3", "e0", "e1", "e2", "e3"))
    return f"""{{
.reg .b32 t1, t2, t3, a0, a1, a2, a3, one;
.reg .b16 h0, h1;
.reg .f32 d0, d1, d2, d3, e0, e1, e2, e3, sg, sg8, zg, zg8, c0, c1, c2, c3;
mov.b32 one, {one};
{clear}{"".join(body)}{halves(f"${scale}", "sg", "sg8")}{zeros}mov.b32 c0, ${acc};
mov.b32 c1, ${acc + 1};
mov.b32 c2, ${acc + 2};
mov.b32 c3, ${acc + 3};
neg.f32 zg, zg;
neg.f32 zg8, zg8;
fma.rn.f32 d0, zg, e0, d0;
fma.rn.f32 d1, zg, e1, d1;
fma.rn.f32 d2, zg8, e2, d2;
fma.rn.f32 d3, zg8, e3, d3;
fma.rn.f32 c0, d0, sg, c0;
fma.rn.f32 c1, d1, sg, c1;
fma.rn.f32 c2, d2, sg8, c2;
fma.rn.f32 c3, d3, sg8, c3;
mov.b32 $0, c0;
mov.b32 $1, c1;
mov.b32 $2, c2;
mov.b32 $3, c3;
}}"""


def _operands(steps: int) -> str:
    return ",".join(["=r"] * 4 + ["r"] * (12 * steps + 12))


#: the PTX of one call and its operand constraints, by (x's dtype, steps a call, symmetric)
PACKS = {(dtype, steps, sym): (_pack_asm(ty, steps, sym), _operands(steps))
         for dtype, ty in ((torch.bfloat16, "bf16"), (torch.float16, "f16")) for steps in (1, 2)
         for sym in (False, True)}
# one 32-bit load for four elements (a physical row's pair, the same for all four)
_ROW_PAIR = tl.constexpr("ld.global.nc.b32 $0, [$4];\nmov.b32 $1, $0;\nmov.b32 $2, $0;\nmov.b32 $3, $0;")
# a lane's x for its four words: eight pairs from $8 (its first) plus $12 bytes, the two
# pairs of word i into $i and $(4 + i), which the pack reads as one MMA's B registers
_X_PAIRS = tl.constexpr("""{
.reg .u64 a;
add.s64 a, $8, $12;
ld.global.v4.b32 {$0, $4, $1, $5}, [a];
ld.global.v4.b32 {$2, $6, $3, $7}, [a+16];
}""")


@triton.jit
def _pack(words, xa, xb, words2, xa2, xb2, acc, s_pair, z_pair, STEPS: tl.constexpr, PACK_ASM: tl.constexpr,
          PACK_OPERANDS: tl.constexpr):
    """The accumulator after one call (``STEPS`` steps, the second's operands ``*2``)."""
    acc_bits = acc.to(tl.int32, bitcast=True)
    if STEPS == 2:
        bits = tl.inline_asm_elementwise(PACK_ASM, PACK_OPERANDS,
                                         [words, xa, xb, words2, xa2, xb2, acc_bits, s_pair, z_pair],
                                         dtype=tl.int32, is_pure=True, pack=4)
    else:
        bits = tl.inline_asm_elementwise(PACK_ASM, PACK_OPERANDS, [words, xa, xb, acc_bits, s_pair, z_pair],
                                         dtype=tl.int32, is_pure=True, pack=4)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _row_pairs(ptrs, EMULATE: tl.constexpr):
    """int32 [BLOCK_P, 16]: each physical row's pair at ``ptrs`` (one address a row), one
    load per four words."""
    if EMULATE:
        return tl.load(ptrs)
    return tl.inline_asm_elementwise(_ROW_PAIR, "=r,=r,=r,=r,l,l,l,l", [ptrs.to(tl.int64)], dtype=tl.int32,
                                     is_pure=True, pack=4)


@triton.jit
def _x_pairs(lane_ptrs, offset):
    """Two int32 [BLOCK_P, 16]: each word's x pairs (B's k 2t..2t+1 and 2t+8..2t+9), from
    ``lane_ptrs`` (the lane's first pair, the same across its four words) plus ``offset``
    bytes."""
    return tl.inline_asm_elementwise(_X_PAIRS, "=r,=r,=r,=r,=r,=r,=r,=r,l,l,l,l,l,l,l,l",
                                     [lane_ptrs.to(tl.int64), offset], dtype=(tl.int32, tl.int32),
                                     is_pure=True, pack=4)


@triton.jit
def _half_value(pair, HIGH: tl.constexpr, X_BF16: tl.constexpr):
    """float32 of the low or high 16-bit float of int32 ``pair`` (bf16 or fp16)."""
    if X_BF16:
        if HIGH:
            return (pair & -65536).to(tl.float32, bitcast=True)
        return (pair << 16).to(tl.float32, bitcast=True)
    if HIGH:
        return ((pair >> 16) & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return (pair & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _emulated_step(words, x_ptr, stride_xm, k0, M, s_pair, z_pair, SYMMETRIC: tl.constexpr, X_BF16: tl.constexpr):
    """What the pack of one step adds to the accumulator, in Triton operations on the same
    layout: every word's eight weights against every x row, summed per physical row into
    D (rows g and g + 8 by x row), scaled, and placed where the MMA leaves it (lane t's
    slots u = 0..3: rows g, g, g+8, g+8 at x rows 2t, 2t+1, 2t, 2t+1)."""
    c = tl.arange(0, 16)
    j = tl.arange(0, 8)
    pair = 8 * (c // 4)[:, None] + 2 * (c % 4)[:, None] + ((j[None, :] >> 1) & 1)  # [16, 8]
    col = 2 * pair + (j[None, :] >> 2)
    xr = tl.arange(0, 8)
    x_rows = tl.where(xr < M, xr, 0)
    xv = tl.load(x_ptr + x_rows[:, None, None] * stride_xm + k0 + col[None, :, :]).to(tl.float32)  # [8, 16, 8]
    q = ((words[:, :, None] >> (4 * j)[None, None, :]) & 0xF).to(tl.float32)  # [BLOCK_P, 16, 8]
    if SYMMETRIC:
        v = q - 8.0
    else:  # the pairs hold magic + z
        magic = 128.0 if X_BF16 else 1024.0
        zg = _half_value(z_pair, False, X_BF16)[:, :, None]
        zg8 = _half_value(z_pair, True, X_BF16)[:, :, None]
        v = q + magic - tl.where((j & 1)[None, None, :] == 0, zg, zg8)
    odd = (j & 1)[None, None, None, :] == 1
    prod = v[:, None, :, :] * xv[None, :, :, :]  # [BLOCK_P, 8 x rows, 16, 8]
    d_g = tl.sum(tl.sum(tl.where(odd, 0.0, prod), 3), 2)  # [BLOCK_P, 8]
    d_g8 = tl.sum(tl.sum(tl.where(odd, prod, 0.0), 3), 2)
    u = c % 4
    sel = xr[None, :] == (2 * (c // 4) + (u & 1))[:, None]  # [16, 8]
    picked_g = tl.sum(tl.where(sel[None, :, :], d_g[:, None, :], 0.0), 2)  # [BLOCK_P, 16]
    picked_g8 = tl.sum(tl.where(sel[None, :, :], d_g8[:, None, :], 0.0), 2)
    s_g = _half_value(s_pair, False, X_BF16)
    s_g8 = _half_value(s_pair, True, X_BF16)
    return tl.where((u >> 1)[None, :] == 1, picked_g8 * s_g8, picked_g * s_g)


@triton.jit(do_not_specialize=["M"])
def _int4_mma_kernel(x_ptr, w_ptr, s_ptr, z_ptr, b_ptr, out_ptr, part_ptr, count_ptr,
                     M, N, P_ROWS, steps_per_split, K_STEPS, splits, stride_xm, stride_wp, stride_sp, stride_zp,
                     stride_om, GROUP_SHIFT: tl.constexpr, STEPS: tl.constexpr, BLOCK_P: tl.constexpr,
                     SYMMETRIC: tl.constexpr,
                     X_BF16: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, USE_PDL: tl.constexpr,
                     EMULATE: tl.constexpr, ROUND: tl.constexpr, UNROLL: tl.constexpr, PACK_ASM: tl.constexpr,
                     PACK_OPERANDS: tl.constexpr):
    pid = tl.program_id(0)
    split = tl.program_id(1)
    offs_p = pid * BLOCK_P + tl.arange(0, BLOCK_P)
    safe_p = tl.where(offs_p < P_ROWS, offs_p, 0)[:, None]  # rows past the end read row 0, never stored
    c = tl.arange(0, 16)[None, :]
    w_rows = w_ptr + safe_p.to(tl.int64) * stride_wp
    s_rows = tl.broadcast_to(s_ptr + safe_p * stride_sp, [BLOCK_P, 16])
    z_rows = tl.broadcast_to(z_ptr + safe_p * stride_zp, [BLOCK_P, 16])
    # lane (g, t) feeds B's column g: x row g (rows past M read row 0; their D is never
    # stored), pairs 8t .. 8t + 7 of each step
    g = offs_p[:, None] % 8
    x_first = tl.where(g < M, g, 0).to(tl.int64) * (stride_xm // 2)
    x_lanes = x_ptr.to(tl.pointer_type(tl.int32), bitcast=True) + x_first + 8 * (c // 4)
    st_begin = split * steps_per_split
    st_end = tl.minimum(st_begin + steps_per_split, K_STEPS)
    if USE_PDL:  # x comes from the kernel before
        pdl.wait()
    acc = tl.zeros([BLOCK_P, 16], dtype=tl.float32)
    # the words of the next two calls stay in flight while a call computes (.gemv_words);
    # a prefetch past the split's end reads its last call again, never used
    last = st_end - STEPS
    following = tl.load(w_rows + (st_begin * 16 + c))
    following2 = tl.load(w_rows + ((st_begin + STEPS - 1) * 16 + c))
    after = tl.load(w_rows + (tl.minimum(st_begin + STEPS, last) * 16 + c))
    after2 = tl.load(w_rows + ((tl.minimum(st_begin + STEPS, last) + STEPS - 1) * 16 + c))
    for st in tl.range(st_begin, st_end, STEPS, loop_unroll_factor=UNROLL):
        words, words2 = following, following2
        following, following2 = after, after2
        ahead = tl.minimum(st + 2 * STEPS, last)
        after = tl.load(w_rows + (ahead * 16 + c))
        after2 = tl.load(w_rows + ((ahead + STEPS - 1) * 16 + c))
        group = st >> GROUP_SHIFT  # steps are never negative: a shift, not a division
        s_pair = _row_pairs(s_rows + group, EMULATE)
        z_pair = s_pair if SYMMETRIC else _row_pairs(z_rows + group, EMULATE)  # symmetric: unread
        if EMULATE:
            acc += _emulated_step(words, x_ptr, stride_xm, st * _STEP, M, s_pair, z_pair, SYMMETRIC, X_BF16)
            if STEPS == 2:
                acc += _emulated_step(words2, x_ptr, stride_xm, (st + 1) * _STEP, M, s_pair, z_pair, SYMMETRIC,
                                      X_BF16)
        else:
            at = tl.zeros([BLOCK_P, 16], tl.int64) + st.to(tl.int64) * (2 * _STEP)  # bytes: a step is 128
            xa, xb = _x_pairs(x_lanes, at)
            if STEPS == 2:
                xa2, xb2 = _x_pairs(x_lanes, at + 2 * _STEP)
            else:
                xa2, xb2 = xa, xb  # unread
            acc = _pack(words, xa, xb, words2, xa2, xb2, acc, s_pair, z_pair, STEPS, PACK_ASM, PACK_OPERANDS)
    # lane t's slot u: weight row g + 8 (u >> 1) of the tile at x row 2t + (u & 1)
    t = c // 4
    u = c % 4
    w_row = 16 * (offs_p[:, None] // 8) + g + 8 * (u >> 1)
    x_row = 2 * t + (u & 1)
    ok = (w_row < N) & (x_row < M) & (offs_p[:, None] < P_ROWS)
    dest = out_ptr + x_row.to(tl.int64) * stride_om + w_row
    if not SPLIT_K:
        if HAS_BIAS:
            acc += tl.load(b_ptr + w_row, mask=ok, other=0.0).to(tl.float32)
        tl.store(dest, round_to(acc, out_ptr.dtype.element_ty, ROUND), mask=ok)
    else:
        parts = part_ptr + x_row * N + w_row
        tl.store(parts + split * M * N, acc, mask=ok)
        tl.debug_barrier()  # every thread's part is stored before the counter moves
        counter = count_ptr + pid
        if tl.atomic_add(counter, 1, sem="acq_rel") == splits - 1:
            total = tl.zeros_like(acc)
            for s in range(splits):  # part order: the same sum every time
                total += tl.load(parts + s * M * N, mask=ok, other=0.0, cache_modifier=".cg")
            if HAS_BIAS:
                total += tl.load(b_ptr + w_row, mask=ok, other=0.0).to(tl.float32)
            tl.store(dest, round_to(total, out_ptr.dtype.element_ty, ROUND), mask=ok)
            tl.store(counter, 0)


def mma_splits(w: Int4Mma, block_p: int, sms: int) -> int:
    """K parts for about two programs an SM, each at least four steps."""
    programs = triton.cdiv(w.words.shape[0], block_p)
    return 1 if programs >= sms else max(1, min(triton.cdiv(2 * sms, programs), w.k // STEP // 4))


def takes(x: torch.Tensor, w: Int4Mma) -> bool:
    """Whether :func:`int4_mma_matmul` serves ``x`` (else the row-major kernels do)."""
    return (x.dim() == 2 and 0 < x.shape[0] <= MMA_ROWS and x.dtype == w.dtype and x.shape[1] == w.k
            and x.stride(1) == 1 and (x.shape[0] == 1 or x.stride(0) % 8 == 0) and x.data_ptr() % 16 == 0)


def int4_mma_matmul(x: torch.Tensor, w: Int4Mma, bias: torch.Tensor | None = None, *, num_warps: int = 8,
                    splits: int | None = None, unroll: int = 2) -> torch.Tensor:
    """``x`` [M <= 8, K] (w's dtype, rows contiguous and 16-byte aligned) times ``w``:
    [M, N] in x's dtype, float32 sums rounded once."""
    rows = x.shape[0]
    if rows and not takes(x, w):
        raise ValueError("int4_mma_matmul takes up to 8 contiguous, 16-byte aligned rows of x in the weight's dtype")
    out = torch.empty(rows, w.n, dtype=x.dtype, device=x.device)
    if rows == 0:
        return out
    block_p = 8 * num_warps
    p_rows = w.words.shape[0]
    programs = triton.cdiv(p_rows, block_p)
    if splits is None:
        sms = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 132
        splits = mma_splits(w, block_p, sms)
    k_steps, steps = w.k // STEP, call_steps(w.group_size, w.k)
    steps_per_split = triton.cdiv(triton.cdiv(k_steps, splits), steps) * steps  # whole calls
    splits = triton.cdiv(k_steps, steps_per_split)
    if splits > 1:
        parts = torch.empty(splits, rows, w.n, dtype=torch.float32, device=x.device)
        counters = counter_buffer("int4_mma", x.device, programs, 4096)
    else:
        parts = counters = out
    use_pdl = pdl.enabled(x.device)
    zeros = w.zeros if w.zeros is not None else w.scales
    emulate = x.device.type != "cuda"
    code, operands = PACKS[x.dtype, steps, w.zeros is None]
    _int4_mma_kernel[(programs, splits)](
        x, w.words, w.scales, zeros, bias if bias is not None else out, out, parts, counters,
        rows, w.n, p_rows, steps_per_split, k_steps, splits, x.stride(0), w.words.stride(0), w.scales.stride(0),
        zeros.stride(0), out.stride(0),
        GROUP_SHIFT=(w.group_size // STEP).bit_length() - 1, STEPS=steps, BLOCK_P=block_p, SYMMETRIC=w.zeros is None, X_BF16=x.dtype == torch.bfloat16,
        HAS_BIAS=bias is not None, SPLIT_K=splits > 1, USE_PDL=use_pdl, EMULATE=emulate,
        ROUND=emulate and x.dtype == torch.bfloat16, UNROLL=1 if emulate else unroll,
        PACK_ASM=code, PACK_OPERANDS=operands, num_warps=num_warps, num_stages=1, **pdl.launch_options(use_pdl),
    )
    return out
