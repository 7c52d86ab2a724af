"""What the few-row tensor-core kernels (:mod:`.int4_mma`, :mod:`.fp8_mma`) share: which
weight rows and x columns a lane holds, x's per-lane loads, the launch's grid and K parts,
and where an ``mma.sync`` m16n8k16 leaves its sums and how they are stored or summed over
K parts.

Both kernels give a warp 16 weight rows and up to eight rows of x as the MMA's B. Lane
``l`` (``g = l // 4``, ``t = l % 4``) gets D's rows ``g`` and ``g + 8`` at x rows ``2t``
and ``2t + 1``: in a ``[8 * num_warps, 16]`` tile of four values a lane, its slot ``u``
is weight row ``g + 8 (u >> 1)`` at x row ``2t + (u & 1)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import triton
import triton.language as tl

from ninfer_kernels.triton.counters import counter_buffer
from ninfer_kernels.triton.quant_launch import k_parts_to_fill
from ninfer_kernels.triton.rounding import round_to

#: rows of x one launch covers (the MMA's n)
MMA_ROWS = 8
#: K columns a step of either kernel
STEP = 128


def mma_splits(n: int, k: int, num_warps: int, sms: int, tiles: int = 1) -> int:
    """K parts for about two programs an SM, each at least four steps: the quantized GEMM's
    rule (:func:`.quant_launch.k_parts_to_fill`) for this kernel's row blocks."""
    return k_parts_to_fill(triton.cdiv(n, 16 * tiles * num_warps), k, sms, STEP)


def lane_loads_asm(loads: list[tuple[int, tuple[int, int, int, int]]]) -> str:
    """PTX for :func:`lane_words`: for each ``(offset, outputs)``, 16 bytes from the lane's
    address ($16) plus its offset ($20) plus ``offset`` bytes into the four outputs named."""
    body = "".join(f"ld.global.v4.b32 {{{', '.join(f'${r}' for r in regs)}}}, [a+{offset}];\n"
                   for offset, regs in loads)
    return "{\n.reg .u64 a;\nadd.s64 a, $16, $20;\n" + body + "}"


@triton.jit
def lane_words(code: tl.constexpr, lane_ptrs, offset):
    """Four int32 [BLOCK_P, 16]: 16 words a lane from ``lane_ptrs`` (each lane's first
    element) plus ``offset`` bytes, loaded as ``code`` (:func:`lane_loads_asm`) says."""
    return tl.inline_asm_elementwise(code, "=r,=r,=r,=r,=r,=r,=r,=r,=r,=r,=r,=r,=r,=r,=r,=r,l,l,l,l,l,l,l,l",
                                     [lane_ptrs.to(tl.int64), offset], dtype=(tl.int32, tl.int32, tl.int32, tl.int32),
                                     is_pure=True, pack=4)


@triton.jit
def tile_rows(BLOCK_P: tl.constexpr, TILES: tl.constexpr):
    """A program's rows: each warp ``TILES`` tiles of 16, a lane's rows g and g + 8 of each
    (the second tile's the first's again when ``TILES`` is 1, never stored twice), and the
    tile columns ``c`` [1, 16] (lane t holds c = 4t .. 4t + 3)."""
    offs_p = tl.arange(0, BLOCK_P)
    rows_a = tl.program_id(0) * 2 * TILES * BLOCK_P + 16 * TILES * (offs_p // 8) + offs_p % 8
    rows_a2 = rows_a + 16 * (TILES - 1)
    return rows_a, rows_a + 8, rows_a2, rows_a2 + 8, tl.arange(0, 16)[None, :]


@triton.jit
def x_lanes(x_ptr, M, stride_xm, BLOCK_P: tl.constexpr, PAIRS: tl.constexpr):
    """Each lane's first x pair (int32 pointers [BLOCK_P, 16]): lane (g, t) feeds B's column
    g, x row g (rows past M read row 0; their sums are never stored), from pair ``PAIRS * t``
    of each block of a step."""
    g = tl.arange(0, BLOCK_P) % 8
    first = tl.where(g < M, g, 0)[:, None].to(tl.int64) * (stride_xm // 2)
    return x_ptr.to(tl.pointer_type(tl.int32), bitcast=True) + first + PAIRS * (tl.arange(0, 16)[None, :] // 4)


@dataclass(frozen=True)
class Launch:
    """A launch's grid (``programs`` row blocks by ``splits`` K parts of ``steps_per_split``
    steps), its output and, split, the float32 parts and arrival counters."""

    out: torch.Tensor
    parts: torch.Tensor
    counters: torch.Tensor
    programs: int
    splits: int
    steps_per_split: int
    k_steps: int


def plan_launch(x: torch.Tensor, n: int, k: int, num_warps: int, tiles: int, splits: int | None,
                splits_for: Callable[[int, int, int, int, int], int], owner: str) -> Launch:
    """The grid for ``x`` [M, K] times an [N, K] weight at ``num_warps`` warps of ``tiles``
    16-row tiles: ``splits`` K parts, or ``splits_for(n, k, warps, sms, tiles)``'s, evened
    out so none is empty; ``owner`` names the kernel's counters."""
    out = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
    programs = triton.cdiv(n, 16 * tiles * num_warps)
    if splits is None:
        sms = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 132
        splits = splits_for(n, k, num_warps, sms, tiles)
    k_steps = k // STEP
    steps_per_split = triton.cdiv(k_steps, splits)
    splits = triton.cdiv(k_steps, steps_per_split)
    if splits > 1:
        parts = torch.empty(splits, x.shape[0], n, dtype=torch.float32, device=x.device)
        counters = counter_buffer(owner, x.device, programs * tiles, 4096)
    else:
        parts = counters = out
    return Launch(out, parts, counters, programs, splits, steps_per_split, k_steps)


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


@triton.jit
def finish_tiles(acc, acc2, rows_a, rows_b, rows_a2, rows_b2, c, M, N, b_ptr, out_ptr, part_ptr, count_ptr, split,
                 splits, stride_om, TILES: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr,
                 ROUND: tl.constexpr):
    """:func:`finish_tile` for each of a program's ``TILES`` tiles, each with its own counter."""
    counters = count_ptr + tl.program_id(0) * TILES
    finish_tile(acc, rows_a, rows_b, c, M, N, b_ptr, out_ptr, part_ptr, counters, split, splits, stride_om,
                HAS_BIAS, SPLIT_K, ROUND)
    if TILES == 2:
        finish_tile(acc2, rows_a2, rows_b2, c, M, N, b_ptr, out_ptr, part_ptr, counters + 1, split, splits, stride_om,
                    HAS_BIAS, SPLIT_K, ROUND)
