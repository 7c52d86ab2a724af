"""A device round's verdict, drafter inputs and advance, one launch each (contract:
:mod:`ninfer_kernels.spec_rounds`).

One program per verify row; a row's ``w`` positions are the lanes of one small vector, so
each kernel is a handful of loads and stores. The advance reads the row's old position,
length and scratch rows before it overwrites them; every value it stores depends on what
it loaded, so no store can pass its load, and rows never touch each other's entries.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ninfer_kernels.spec_rounds import PAD


@triton.jit
def _paged_slot(table_ptr, at, pages, table_cols, block_size, mask):
    """KV slots of positions ``at`` through one row's block table; -1 past its ``pages``."""
    page = at // block_size
    block = tl.load(table_ptr + tl.minimum(tl.maximum(page, 0), table_cols - 1), mask=mask, other=0).to(tl.int64)
    return tl.where(page < pages, block * block_size + at % block_size, -1)


@triton.jit
def _verdict_kernel(ids_ptr, num_drafts_ptr, target_ptr, rows_ptr, accepted_ptr, tokens_ptr, kept_ptr,
                    W: tl.constexpr, WP: tl.constexpr, HAS_ROWS: tl.constexpr, PAD_ID: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, WP)
    is_draft = j < W - 1
    drafts = tl.load(ids_ptr + b * W + 1 + j, mask=is_draft, other=PAD_ID)
    target = tl.load(target_ptr + b * W + j, mask=j < W, other=PAD_ID)
    real = tl.load(num_drafts_ptr + b)
    ok = (drafts == target) & is_draft & (j < real)
    # the first draft that fails, or k when none does (lane k never matches)
    accepted = tl.min(tl.where(ok, WP, j), axis=0)
    final = tl.sum(tl.where(j == accepted, target, 0), axis=0)
    tokens = tl.where(j < accepted, drafts, tl.where(j == accepted, final, PAD_ID))
    tl.store(tokens_ptr + b * W + j, tokens, mask=j < W)
    tl.store(accepted_ptr + b, accepted.to(tl.int64))
    if HAS_ROWS:
        tl.store(kept_ptr + b, tl.load(rows_ptr + b * W + accepted))


def round_verdict(
    ids: torch.Tensor, num_drafts: torch.Tensor, target: torch.Tensor, position_rows: Optional[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """Same contract as the reference."""
    bs, w = target.shape
    accepted = torch.empty(bs, dtype=torch.int64, device=ids.device)
    tokens = torch.empty(bs, w, dtype=torch.int64, device=ids.device)
    kept = torch.empty(bs, dtype=torch.int64, device=ids.device) if position_rows is not None else None
    if bs:
        _verdict_kernel[(bs,)](
            ids, num_drafts, target.contiguous(), position_rows if kept is not None else accepted, accepted, tokens,
            kept if kept is not None else accepted, W=w, WP=triton.next_power_of_2(w),
            HAS_ROWS=kept is not None, PAD_ID=PAD, num_warps=1,
        )
    return accepted, tokens, kept


@triton.jit
def _advance_kernel(tokens_ptr, accepted_ptr, drafts_ptr, ids_ptr, positions_ptr, slots_ptr, seq_lens_ptr,
                    num_drafts_ptr, pages_ptr, tables_ptr, rows_ptr, out_ptr,
                    stride_table, table_cols, block_size, bank_first, bank_rows,
                    W: tl.constexpr, WP: tl.constexpr, BANKED: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, WP)
    lane = j < W
    k = W - 1
    accepted = tl.load(accepted_ptr + b)
    pages = tl.load(pages_ptr + b)
    live = pages > 0
    start = tl.load(positions_ptr + b * W)
    tokens = tl.load(tokens_ptr + b * W + j, mask=lane, other=0)
    drafts = tl.load(drafts_ptr + b * k + j - 1, mask=lane & (j >= 1), other=0)
    # the row the host reads: drafts kept, committed tokens, next drafts
    out = out_ptr + b * (1 + W + k)
    tl.store(out + j, tl.where(j == 0, accepted, 0), mask=j == 0)
    tl.store(out + 1 + j, tokens, mask=lane)
    tl.store(out + W + j, drafts, mask=lane & (j >= 1))
    bonus = tl.sum(tl.where(j == accepted, tokens, 0), axis=0)
    nxt = tl.where(live, start + accepted + 1, start)
    positions = nxt + j
    slots = _paged_slot(tables_ptr + b * stride_table, positions, pages, table_cols, block_size, lane)
    ids = tl.maximum(tl.where(j == 0, bonus, drafts), 0)
    tl.store(ids_ptr + b * W + j, ids, mask=lane)
    tl.store(positions_ptr + b * W + j, positions, mask=lane)
    tl.store(slots_ptr + b * W + j, slots, mask=lane)
    old_len = tl.load(seq_lens_ptr + b)
    tl.store(seq_lens_ptr + b, tl.where(live, nxt + W, old_len))
    tl.store(num_drafts_ptr + b, tl.where(live, k, 0).to(tl.int64))
    if BANKED:
        rows = tl.load(rows_ptr + b * W + j, mask=lane, other=0)
        other = tl.where(rows >= bank_first + bank_rows, rows - bank_rows, rows + bank_rows)
        tl.store(rows_ptr + b * W + j, tl.where(live, other, rows), mask=lane)


def round_advance(
    tokens: torch.Tensor, accepted: torch.Tensor, drafts: torch.Tensor, input_ids: torch.Tensor,
    positions: torch.Tensor, slot_mapping: torch.Tensor, seq_lens: torch.Tensor, num_drafts: torch.Tensor,
    pages: torch.Tensor, block_tables: torch.Tensor, block_size: int,
    position_rows: Optional[torch.Tensor] = None, bank_first: int = 0, bank_rows: int = 0,
) -> torch.Tensor:
    """Same contract as the reference."""
    bs, w = tokens.shape
    out = torch.empty(bs, 2 * w, dtype=torch.int64, device=tokens.device)
    if bs:
        banked = bool(bank_rows)
        _advance_kernel[(bs,)](
            tokens.contiguous(), accepted, drafts.contiguous(), input_ids, positions, slot_mapping, seq_lens,
            num_drafts, pages, block_tables, position_rows if banked else positions, out,
            block_tables.stride(0), block_tables.shape[1], block_size, bank_first, bank_rows,
            W=w, WP=triton.next_power_of_2(w), BANKED=banked, num_warps=1,
        )
    return out


@triton.jit
def _chain_inputs_kernel(tokens_ptr, accepted_ptr, starts_ptr, tables_ptr, pages_ptr, ids_ptr, positions_ptr,
                         slots_ptr, lens_ptr, last_ptr, chain_pos_ptr, chain_lens_ptr, chain_slots_ptr,
                         bs, stride_starts, stride_table, table_cols, block_size,
                         W: tl.constexpr, CHAIN: tl.constexpr, LANES: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, LANES)
    lane = j < W
    chain = j < CHAIN
    accepted = tl.load(accepted_ptr + b)
    start = tl.load(starts_ptr + b * stride_starts)  # (a column of the round's positions)
    pages = tl.load(pages_ptr + b)
    table = tables_ptr + b * stride_table
    tokens = tl.load(tokens_ptr + b * W + j, mask=lane, other=0)
    tl.store(ids_ptr + b * W + j, tl.maximum(tokens, 0), mask=lane)
    # the verified positions (KV only for the kept ones), then the chain's after the last kept
    positions = start + j
    slots = _paged_slot(table, positions, pages, table_cols, block_size, lane)
    tl.store(positions_ptr + b * W + j, positions, mask=lane)
    tl.store(slots_ptr + b * W + j, tl.where(j <= accepted, slots, -1), mask=lane)
    chained = start + accepted + 1 + j
    tl.store(chain_pos_ptr + j * bs + b, chained, mask=chain)
    tl.store(chain_lens_ptr + j * bs + b, chained + 1, mask=chain)
    tl.store(chain_slots_ptr + j * bs + b, _paged_slot(table, chained, pages, table_cols, block_size, chain),
             mask=chain)
    tl.store(lens_ptr + b, start + W)
    tl.store(last_ptr + b, b * W + accepted)


def draft_chain_inputs(
    tokens: torch.Tensor, accepted: torch.Tensor, starts: torch.Tensor, block_tables: torch.Tensor,
    pages: torch.Tensor, block_size: int, k: int,
) -> tuple[torch.Tensor, ...]:
    """Same contract as the reference."""
    bs, w = tokens.shape
    dev = tokens.device
    flat = [torch.empty(bs * w, dtype=torch.int64, device=dev) for _ in range(3)]
    rows = [torch.empty(bs, dtype=torch.int64, device=dev) for _ in range(2)]
    chain = [torch.empty(max(k - 1, 0), bs, dtype=torch.int64, device=dev) for _ in range(3)]
    if bs:
        _chain_inputs_kernel[(bs,)](
            tokens.contiguous(), accepted, starts, block_tables, pages, *flat, *rows, *chain,
            bs, starts.stride(0), block_tables.stride(0), block_tables.shape[1], block_size,
            W=w, CHAIN=k - 1, LANES=triton.next_power_of_2(max(w, k - 1, 1)), num_warps=1,
        )
    return (*flat, *rows, *chain)
