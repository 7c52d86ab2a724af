"""Asking L2 for lines a kernel will read later, without waiting for them.

At batch 1 most of a decode step's projections follow a kernel that is bound by memory
latency, not bandwidth (the Gated DeltaNet step, decode attention, a norm): while it runs
the memory bus is mostly idle. A projection launched with PDL already starts during that
kernel and fetches its first weight tile before waiting for it; with :func:`prefetch_l2`
it can also ask for the tiles after that, so their bytes stream into L2 while the kernel
before still runs, and its loop then reads them from L2. A prefetch is fire-and-forget:
the program does not wait for it, and a line that is evicted again is only read twice.

Triton has no prefetch of its own, so this is PTX: ``prefetch.global.L2`` per lane, one
lane per 128-byte line (callers pass pointers spaced a line apart), or a bulk prefetch of
a whole range per lane. Only on the GPU: the
interpreter has no inline assembly, so callers gate it on a constexpr that is false there.
"""

from __future__ import annotations

import triton
import triton.language as tl

#: bytes an L2 line holds (one prefetch per line)
LINE_BYTES = 128


@triton.jit
def prefetch_l2(ptrs, mask):
    """Prefetch into L2 the lines holding ``ptrs`` where ``mask`` holds (a predicated PTX
    prefetch: masked lanes issue nothing). The returned zeros are there for the inline
    assembly's required output; the op is marked impure, so it is never removed."""
    addrs = ptrs.to(tl.int64)
    return tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.u32 $0, 0; }",
        "=r,l,r", [addrs, mask.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1,
    )


@triton.jit
def prefetch_l2_bulk(ptrs, nbytes, mask):
    """Prefetch ``nbytes`` (int32, a multiple of 16, as are the addresses) from each of
    ``ptrs`` into L2 where ``mask`` holds: Hopper's bulk prefetch, one instruction a range,
    so one program can ask for megabytes (``cp.async.bulk.prefetch.L2``, sm_90)."""
    addrs = ptrs.to(tl.int64)
    return tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.b32 p, $3, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r,r", [addrs, nbytes.to(tl.int32), mask.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1,
    )


def line_grid(block_n: int, block_k: int, element_bytes: int, k_contiguous: bool) -> tuple[int, int, int, int]:
    """(positions along N, their step, positions along K, their step) that touch each
    128-byte line of a [block_n, block_k] weight tile once: along the contiguous dimension
    one position a line, along the other every row."""
    per_line = max(1, LINE_BYTES // element_bytes)
    if k_contiguous:
        return block_n, 1, max(1, block_k // per_line), per_line
    return max(1, block_n // per_line), per_line, block_k, 1

