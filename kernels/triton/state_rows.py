"""Copying state rows between slots of many pools in one launch.

See :mod:`ninfer_kernels.state_rows` for the contract. The pools differ in shape and
dtype, so the kernel sees them as rows of 32-bit words (2-byte units when some row is
not a whole number of words) through a table of base addresses built once per pool list
and kept, like the decode kernels' counter buffers, for graphs that capture it.
Programs are (pool, pair, part); each part copies every ``PARTS``-th block of its row,
so a row of megabytes (the delta-rule state) and one of kilobytes (the conv history)
both keep enough blocks in flight.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

#: programs per (pool, pair), and words per block: enough loads in flight for the
#: largest rows (27B: 3 MiB of delta-rule state per layer and slot) without idling on small ones
PARTS = 16
BLOCK = 1024

_tables: dict[tuple, tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.dtype]] = {}


@triton.jit
def _copy_rows_kernel(base_ptr, words_ptr, stride_ptr, src_ptr, dst_ptr,
                      UNIT: tl.constexpr, PARTS: tl.constexpr, BLOCK: tl.constexpr):
    pool = tl.program_id(0)
    pair = tl.program_id(1)
    part = tl.program_id(2)
    base = tl.load(base_ptr + pool).to(tl.pointer_type(UNIT))
    words = tl.load(words_ptr + pool)
    stride = tl.load(stride_ptr + pool)
    src_row = tl.load(src_ptr + pair)
    dst_row = tl.load(dst_ptr + pair)
    src = base + src_row * stride
    dst = base + dst_row * stride
    # a row onto itself (a device round's padding rows) moves nothing
    end = tl.where(src_row == dst_row, 0, words)
    for start in range(part * BLOCK, end, PARTS * BLOCK):
        offs = start + tl.arange(0, BLOCK)
        ok = offs < words
        tl.store(dst + offs, tl.load(src + offs, mask=ok), mask=ok)


def _table(pools: list[torch.Tensor]):
    """(base addresses, words per row, words between rows, unit) of ``pools``, cached."""
    key = tuple((p.data_ptr(), p.shape, p.stride(), p.dtype) for p in pools)
    found = _tables.get(key)
    if found is not None:
        return found
    for p in pools:
        if not p[0].is_contiguous():
            raise ValueError("state pools must be contiguous within a row")
    row_bytes = [p[0].numel() * p.element_size() for p in pools]
    stride_bytes = [p.stride(0) * p.element_size() for p in pools]
    words = all(b % 4 == 0 for b in row_bytes + stride_bytes) and all(p.data_ptr() % 4 == 0 for p in pools)
    size = 4 if words else 2
    unit = tl.int32 if words else tl.int16
    dev = pools[0].device
    found = (
        torch.tensor([p.data_ptr() for p in pools], dtype=torch.int64, device=dev),
        torch.tensor([b // size for b in row_bytes], dtype=torch.int64, device=dev),
        torch.tensor([b // size for b in stride_bytes], dtype=torch.int64, device=dev),
        unit,
    )
    _tables[key] = found
    return found


def copy_rows(pools: list[torch.Tensor], src: torch.Tensor, dst: torch.Tensor) -> None:
    """Same contract as the reference."""
    if not pools or src.numel() == 0:
        return
    if src.shape != dst.shape:
        raise ValueError("src and dst must list the same number of rows")
    bases, words, strides, unit = _table(pools)
    _copy_rows_kernel[(len(pools), src.numel(), PARTS)](
        bases, words, strides, src, dst, UNIT=unit, PARTS=PARTS, BLOCK=BLOCK, num_warps=4,
    )
