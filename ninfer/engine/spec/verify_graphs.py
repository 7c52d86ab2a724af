"""Verify steps replayed from CUDA graphs: one captured forward per batch bucket.

A verify step has the decode step's shape problem: ``width`` (1 + the draft count) rows
per sequence through every layer, hundreds of small launches eagerly; captured, one
replay. Graphs exist for one width (the engine's ``draft_tokens + 1``) and the decode
buckets up to ``max_batch`` sequences; a step whose rows are all verify rows of that
width, without LoRA or prompt log probabilities, replays the smallest bucket that holds
it (other steps run eagerly).

The static inputs: ``width`` token ids, positions and KV slots per sequence, one context
length and block table per sequence, and for recurrent state the working slot and the
per-position scratch rows (:class:`ninfer.engine.spec.scratch.VerifyScratch`). Padding
sequences write no KV (slot -1), keep a context of ``width`` keys (so they start from
zero state), and write their states to the scratch pool's trash row.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import numpy as np
import torch

from ninfer.engine.cuda_graph import StagedInputs, buckets_up_to, capture_buckets
from ninfer.engine.spec.scratch import VerifyScratch
from ninfer.model.forward_batch import ForwardBatch, VerifyRows


class VerifyGraphs:
    def __init__(self, model, max_batch: int, width: int, max_context: int, block_size: int,
                 device: torch.device, scratch: Optional[VerifyScratch] = None):
        self.model, self.width, self.block_size = model, width, block_size
        self.max_context, self.device, self.scratch = max_context, device, scratch
        self.buckets = buckets_up_to(max_batch)
        self.max_blocks = -(-max_context // block_size)
        n, w = self.buckets[-1], width
        i32 = dict(dtype=torch.int32, device=device)
        # num_drafts and pages are read only by device rounds (:mod:`.device_rounds`)
        fields = [("input_ids", n * w), ("positions", n * w), ("slot_mapping", n * w), ("seq_lens", n),
                  ("num_drafts", n), ("pages", n)]
        if scratch is not None:
            fields += [("state_slots", n), ("position_rows", n * w)]
        self._staged = StagedInputs(fields, n, self.max_blocks, device)
        self.input_ids, self.positions, self.slot_mapping, self.seq_lens = (
            self._staged.device(f) for f in ("input_ids", "positions", "slot_mapping", "seq_lens"))
        self.num_drafts, self.pages = self._staged.device("num_drafts"), self._staged.device("pages")
        self.slot_mapping.fill_(-1)
        self.seq_lens.fill_(w)
        if scratch is not None:
            self.state_slots = self._staged.device("state_slots").fill_(scratch.trash_row)
            self.position_rows = self._staged.device("position_rows").view(n, w).fill_(scratch.trash_row)
        self.block_tables = self._staged.block_tables
        self.query_start = torch.arange(n + 1, **i32) * w
        self.rows = torch.arange(n * w, dtype=torch.int64, device=device)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._hidden: dict[int, torch.Tensor] = {}

    def batch(self, bs: int, seq_lens_host: Optional[list[int]] = None) -> ForwardBatch:
        """Views of the static buffers for bucket ``bs``. CUDA kernels read only device
        tensors; the CPU reference reads ``seq_lens_host`` (given by :meth:`forward_staged`)."""
        w = self.width
        lens = seq_lens_host or [w] * bs
        batch = ForwardBatch(
            query_start=self.query_start[: bs + 1], seq_lens=self.seq_lens[:bs], block_tables=self.block_tables[:bs],
            slot_mapping=self.slot_mapping[: bs * w], logits_indices=self.rows[: bs * w], block_size=self.block_size,
            max_query_len=w, max_seq_len=self.max_context, query_lens_host=[w] * bs, seq_lens_host=lens,
            rows_per_seq=w,
        )
        if self.scratch is not None:
            batch.state_slots = self.state_slots[:bs]
            head = dataclasses.replace(batch)  # every sequence is a verify row (padding included)
            batch.verify = VerifyRows(bs, w, head, self.position_rows[:bs])
        return batch

    def capture(self) -> None:
        def forward(bs: int) -> torch.Tensor:
            w = self.width
            return self.model(self.input_ids[: bs * w], self.positions[: bs * w], self.batch(bs))

        self._graphs, self._hidden = capture_buckets(self.buckets, forward, self.device,
                                                     f"verify (width {self.width})")

    def bucket_for(self, num_seqs: int) -> Optional[int]:
        return next((b for b in self.buckets if b >= num_seqs), None)

    def replay(self, bucket: int) -> None:
        self._graphs[bucket].replay()

    def output(self, bucket: int) -> torch.Tensor:
        """The hidden rows bucket ``bucket`` writes when replayed (``width`` per sequence)."""
        return self._hidden[bucket]

    def run(self, token_ids: Sequence[int], starts: Sequence[int], block_tables: Sequence[Sequence[int]],
            state_slots: Optional[Sequence[int]] = None) -> torch.Tensor:
        """Replay the verify step of ``len(starts)`` sequences: sequence ``i`` feeds
        ``token_ids[i*width:(i+1)*width]`` at positions ``starts[i]...``; returns their
        hidden rows [B * width, hidden], sequence-major."""
        bs = self.stage_inputs(token_ids, starts, block_tables, state_slots)
        self._graphs[bs].replay()
        return self._hidden[bs][: len(starts) * self.width]

    def forward_staged(self, bucket: int) -> torch.Tensor:
        """The captured forward run eagerly on the staged inputs (tests check staging on CPU)."""
        w = self.width
        return self.model(self.input_ids[: bucket * w], self.positions[: bucket * w],
                          self.batch(bucket, self.seq_lens[:bucket].tolist()))

    def stage_inputs(self, token_ids: Sequence[int], starts: Sequence[int], block_tables: Sequence[Sequence[int]],
                     state_slots: Optional[Sequence[int]] = None,
                     num_drafts: Optional[Sequence[int]] = None) -> int:
        """Fill the static inputs for this step; returns the bucket to replay. ``num_drafts``:
        the valid drafts of each row (default: all ``width - 1``; padding rows get 0)."""
        num, w, bsz = len(starts), self.width, self.block_size
        bs = self.bucket_for(num)
        assert bs is not None, "batch larger than the largest captured bucket"
        staged = self._staged
        staged.begin()
        pos = np.fromiter(starts, dtype=np.int64, count=num)[:, None] + np.arange(w)
        width = max(len(t) for t in block_tables)
        table = np.zeros((bs, width), dtype=np.int64)
        pages = np.empty(num, dtype=np.int64)
        for i, t in enumerate(block_tables):
            table[i, : len(t)] = t
            pages[i] = len(t)
        page = pos // bsz
        inside = page < pages[:, None]  # padding drafts past a row's pages write no KV
        slots = np.where(inside, table[np.arange(num)[:, None], np.minimum(page, width - 1)] * bsz + pos % bsz, -1)
        ids = staged.host("input_ids", bs * w)
        ids[:] = 0
        ids[: num * w] = token_ids
        positions = staged.host("positions", bs * w)
        positions[:] = 0
        positions[: num * w] = pos.reshape(-1)
        kv = staged.host("slot_mapping", bs * w)
        kv[:] = -1
        kv[: num * w] = slots.reshape(-1)
        lens = staged.host("seq_lens", bs)
        lens[:] = w
        lens[:num] = pos[:, -1] + 1
        valid = staged.host("num_drafts", bs)
        valid[:] = 0
        valid[:num] = w - 1 if num_drafts is None else np.fromiter(num_drafts, dtype=np.int64, count=num)
        held_pages = staged.host("pages", bs)
        held_pages[:] = 0
        held_pages[:num] = pages
        if self.scratch is not None:
            trash = self.scratch.trash_row
            working = np.fromiter(state_slots, dtype=np.int64, count=num)
            rows = staged.host("position_rows", (bs, w))
            rows[:] = trash
            rows[:num] = self.scratch.row_array(working, w)
            held = staged.host("state_slots", bs)
            held[:] = trash
            held[:num] = working
        staged.send(table)
        return bs
