"""The expert-sorted layout of :func:`ninfer_kernels.moe.moe_align` for many pairs, in
four launches spread over the GPU.

A prefill chunk brings thousands of (token, expert) pairs to a MoE layer (a 1,024-token
chunk of the 35B-A3B: 9,216). One program over all of them (:mod:`.moe_route`'s align
kernel) walks them 128 at a time on one SM; torch ops (a stable sort, searches, cumsums)
took over twenty launches, each some microseconds of host time, which a host-bound
chunked prefill pays in every MoE layer of every chunk. Here, the pairs cut in chunks
of ``CHUNK``:

1. count: each program histograms its chunk's experts into its row of a [chunks, E]
   table, and fills its share of the layout with the sentinel;
2. scan: each program takes a block of experts down the chunks, ``SCAN_CHUNKS`` rows a
   step: where each chunk's pairs of an expert start within the expert's run (an
   exclusive prefix sum), and each expert's count;
3. runs: one program pads the counts into runs (:func:`store_runs`, which the one-program
   align kernel shares: each run's first row, the rows covered, every block's expert);
4. scatter: each program moves its chunk's pairs to run start + chunk offset + their
   rank among the chunk's earlier pairs of the same expert.

Pairs keep increasing order within a run (chunks in order, ranks within a chunk), so the
layout is the reference's, bit for bit. The launches use no PDL: each waits for the one
before, as stream order gives.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ninfer_kernels.moe import max_padded_rows

#: pairs a count or scatter program takes (the rank comparison holds CHUNK x CHUNK flags)
CHUNK = 128
#: experts a scan program takes, and chunks it sums a step
SCAN_EXPERTS = 32
SCAN_CHUNKS = 64
#: blocks whose expert the runs program finds a step
BLOCK_CHUNK = 64


@triton.jit
def store_runs(counts, e_ok, rows, block_experts_ptr, num_padded_ptr, BLOCK_M: tl.constexpr,
               BLOCK_CHUNK: tl.constexpr):
    """From each expert's pair count [BLOCK_E] (lanes past ``e_ok`` ignored): store the rows
    the padded runs cover and each of the ``rows // BLOCK_M`` blocks' expert (the first whose
    run ends past the block; -1 past the last run); return each run's first row."""
    counts = tl.where(e_ok, counts, 0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, 0)
    num_padded = tl.sum(padded, 0)
    tl.store(num_padded_ptr, num_padded)
    offs_b = tl.arange(0, BLOCK_CHUNK)
    for b0 in range(0, rows // BLOCK_M, BLOCK_CHUNK):
        first_row = (b0 + offs_b) * BLOCK_M
        before = (ends[None, :] <= first_row[:, None]) & e_ok[None, :]
        expert = tl.sum(before.to(tl.int32), 1)
        expert = tl.where(first_row < num_padded, expert, -1)
        tl.store(block_experts_ptr + b0 + offs_b, expert, mask=b0 + offs_b < rows // BLOCK_M)
    return ends - padded


@triton.jit
def _count_kernel(ids_ptr, counts_ptr, sorted_ptr, pairs, rows, fill_rows,
                  BLOCK_E: tl.constexpr, CHUNK: tl.constexpr):
    c = tl.program_id(0)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    # pairs past the end land in the last bin, never an expert's (BLOCK_E > num_experts)
    e = tl.load(ids_ptr + offs, mask=offs < pairs, other=BLOCK_E - 1)
    tl.store(counts_ptr + c * BLOCK_E + tl.arange(0, BLOCK_E), tl.histogram(e, BLOCK_E))
    first = c * fill_rows
    last = tl.minimum(first + fill_rows, rows)
    for r0 in range(first, last, CHUNK):
        r = r0 + tl.arange(0, CHUNK)
        tl.store(sorted_ptr + r, pairs + r * 0, mask=r < last)


@triton.jit
def _scan_kernel(counts_ptr, base_ptr, totals_ptr, num_chunks,
                 BLOCK_E: tl.constexpr, EXPERTS: tl.constexpr, CHUNKS: tl.constexpr):
    e = tl.program_id(0) * EXPERTS + tl.arange(0, EXPERTS)
    seen = tl.zeros([EXPERTS], dtype=tl.int32)  # each expert's pairs in the chunks before
    for c0 in range(0, num_chunks, CHUNKS):
        cs = c0 + tl.arange(0, CHUNKS)
        where = cs[:, None] * BLOCK_E + e[None, :]
        ok = (cs < num_chunks)[:, None]
        tile = tl.load(counts_ptr + where, mask=ok, other=0)
        tl.store(base_ptr + where, tl.cumsum(tile, 0) - tile + seen[None, :], mask=ok)
        seen += tl.sum(tile, 0)
    tl.store(totals_ptr + e, seen)


@triton.jit(do_not_specialize=["rows"])
def _runs_kernel(totals_ptr, starts_ptr, block_experts_ptr, num_padded_ptr, rows, num_experts,
                 BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_CHUNK: tl.constexpr):
    offs_e = tl.arange(0, BLOCK_E)
    e_ok = offs_e < num_experts
    counts = tl.load(totals_ptr + offs_e, mask=e_ok, other=0)
    starts = store_runs(counts, e_ok, rows, block_experts_ptr, num_padded_ptr, BLOCK_M, BLOCK_CHUNK)
    tl.store(starts_ptr + offs_e, starts, mask=e_ok)


@triton.jit
def _scatter_kernel(ids_ptr, base_ptr, starts_ptr, sorted_ptr, pairs, BLOCK_E: tl.constexpr, CHUNK: tl.constexpr):
    c = tl.program_id(0)
    offs_c = tl.arange(0, CHUNK)
    p = c * CHUNK + offs_c
    ok = p < pairs
    e = tl.load(ids_ptr + p, mask=ok, other=-1)  # -1 matches no real pair
    same = (e[:, None] == e[None, :]) & ok[:, None]
    rank = tl.sum((same & (offs_c[None, :] < offs_c[:, None])).to(tl.int32), 1)
    dest = tl.load(starts_ptr + e, mask=ok, other=0) + tl.load(base_ptr + c * BLOCK_E + e, mask=ok, other=0)
    tl.store(sorted_ptr + dest + rank, p, mask=ok)


def align_grid(ids: torch.Tensor, num_experts: int, block_m: int, chunk: int = CHUNK):
    """Same contract (and output) as :func:`ninfer_kernels.moe.moe_align`, for any pair count
    above zero; ``chunk`` (a power of two) sets the pairs a count or scatter program takes."""
    flat = ids.reshape(-1)
    flat = flat if flat.dtype == torch.int32 and flat.is_contiguous() else flat.to(torch.int32).contiguous()
    pairs = flat.numel()
    if pairs == 0:
        raise ValueError("align_grid needs at least one pair")
    rows = max_padded_rows(pairs, num_experts, block_m)
    dev = ids.device
    sorted_pairs = torch.empty(rows, dtype=torch.int32, device=dev)
    block_experts = torch.empty(rows // block_m, dtype=torch.int32, device=dev)
    num_padded = torch.empty(1, dtype=torch.int32, device=dev)
    # a spare bin for the padding lanes; whole scan blocks
    block_e = max(SCAN_EXPERTS, triton.next_power_of_2(num_experts + 1))
    num_chunks = triton.cdiv(pairs, chunk)
    counts = torch.empty(num_chunks, block_e, dtype=torch.int32, device=dev)
    base = torch.empty_like(counts)
    totals = torch.empty(block_e, dtype=torch.int32, device=dev)
    starts = torch.empty(block_e, dtype=torch.int32, device=dev)
    fill_rows = triton.cdiv(triton.cdiv(rows, num_chunks), chunk) * chunk
    _count_kernel[(num_chunks,)](flat, counts, sorted_pairs, pairs, rows, fill_rows, BLOCK_E=block_e, CHUNK=chunk,
                                 num_warps=4)
    _scan_kernel[(block_e // SCAN_EXPERTS,)](counts, base, totals, num_chunks, BLOCK_E=block_e,
                                             EXPERTS=SCAN_EXPERTS, CHUNKS=SCAN_CHUNKS, num_warps=4)
    _runs_kernel[(1,)](totals, starts, block_experts, num_padded, rows, num_experts, BLOCK_M=block_m,
                       BLOCK_E=block_e, BLOCK_CHUNK=BLOCK_CHUNK, num_warps=8)
    _scatter_kernel[(num_chunks,)](flat, base, starts, sorted_pairs, pairs, BLOCK_E=block_e, CHUNK=chunk,
                                   num_warps=8 if chunk >= 128 else 4)
    return sorted_pairs, block_experts, num_padded
