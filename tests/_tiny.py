"""Helpers for driving a model directly over a paged KV cache, without the engine."""

from __future__ import annotations

import torch

from ninfer.model.forward_batch import ForwardBatch


def varlen_batch(
    steps: list[tuple[int, list[int]]], block_tables: list[list[int]], block_size: int
) -> tuple[torch.Tensor, torch.Tensor, ForwardBatch]:
    """``(input_ids, positions, batch)`` for sequences given as ``(cached_len, new_tokens)``.

    Sequence ``i``'s new tokens take positions ``cached_len ..`` and the KV slots its
    block table maps them to; logits are requested for every row.
    """
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    starts = [0]
    seq_lens = []
    for (cached, new), table in zip(steps, block_tables):
        for pos in range(cached, cached + len(new)):
            positions.append(pos)
            slots.append(table[pos // block_size] * block_size + pos % block_size)
        ids += new
        starts.append(starts[-1] + len(new))
        seq_lens.append(cached + len(new))
    width = max(len(t) for t in block_tables)
    tables = [t + [0] * (width - len(t)) for t in block_tables]
    query_lens = [len(new) for _, new in steps]
    batch = ForwardBatch(
        query_start=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.tensor(tables, dtype=torch.int32),
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        logits_indices=torch.arange(len(ids), dtype=torch.int64),
        block_size=block_size,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_lens_host=query_lens,
        seq_lens_host=seq_lens,
    )
    return torch.tensor(ids, dtype=torch.int64), torch.tensor(positions, dtype=torch.int64), batch


def shuffled_tables(lengths: list[int], block_size: int, seed: int = 0) -> tuple[list[list[int]], int]:
    """Block tables over a randomly permuted page pool (page 0 left unused); returns the
    tables and how many pages the pool needs."""
    counts = [-(-n // block_size) for n in lengths]
    pages = (torch.randperm(sum(counts), generator=torch.Generator().manual_seed(seed)) + 1).tolist()
    tables, start = [], 0
    for c in counts:
        tables.append(pages[start : start + c])
        start += c
    return tables, sum(counts) + 1
