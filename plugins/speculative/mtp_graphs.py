"""The MTP head's drafting after a decode step, replayed from CUDA graphs.

After a decode or verify step the head extends its KV over each row's kept positions
(at most ``width`` = draft tokens + 1 of them) and then chains itself ``k - 1`` more
times: a dozen small kernels per pass, launched from Python ``k`` times a step. Here
the whole of it is captured once per batch bucket and replayed: rows are laid out
``width`` to a sequence (kept positions first; the rest write no KV and are never
read), the last kept row of each sequence starts the chain, and the drafts come back
as one [B, k] tensor of greedy tokens.

Only decode-shaped steps of greedy proposals replay (prefill chunks extend over many
positions, sampled proposals need their q); everything else runs
:meth:`ninfer_plugins.speculative.mtp.MtpProposer` eagerly.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from ninfer.engine.cuda_graph import buckets_up_to, capture_buckets
from ninfer.model.forward_batch import ForwardBatch


class MtpGraphs:
    """``run_head(ids, hidden, positions, batch)`` is the head's forward; ``draft(state)``
    its greedy token per row (the full LM head, or the shortlist)."""

    def __init__(self, run_head: Callable, draft: Callable, hidden_size: int, dtype: torch.dtype, max_batch: int,
                 k: int, max_context: int, block_size: int, device: torch.device):
        self.run_head, self.draft = run_head, draft
        self.k, self.width, self.block_size, self.device = k, k + 1, block_size, device
        self.max_context = max_context
        self.buckets = buckets_up_to(max_batch)
        self.max_blocks = -(-max_context // block_size)
        n, w = self.buckets[-1], self.width
        i64, i32 = dict(dtype=torch.int64, device=device), dict(dtype=torch.int32, device=device)
        self.hidden = torch.zeros(n * w, hidden_size, dtype=dtype, device=device)
        self.ids = torch.zeros(n * w, **i64)
        self.positions = torch.zeros(n * w, **i64)
        self.slot_mapping = torch.full((n * w,), -1, **i64)
        self.seq_lens = torch.full((n,), w, **i64)
        self.block_tables = torch.zeros(n, self.max_blocks, **i32)
        self.query_start = torch.arange(n + 1, **i32) * w
        self.step_start = torch.arange(n + 1, **i32)
        self.last = torch.arange(n, **i64) * w  # each sequence's last kept row
        self.chain_pos = torch.zeros(max(k - 1, 1), n, **i64)
        self.chain_lens = torch.ones(max(k - 1, 1), n, **i64)
        self.chain_slots = torch.full((max(k - 1, 1), n), -1, **i64)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._drafts: dict[int, torch.Tensor] = {}

    def _forward(self, bs: int, seq_lens_host: Optional[list[int]] = None,
                 chain_lens_host: Optional[list[list[int]]] = None) -> torch.Tensor:
        """The captured work for bucket ``bs``: [bs, k] draft tokens. Host lists are only
        read by the CPU reference kernels (tests run this eagerly on staged inputs)."""
        w = self.width
        lens = seq_lens_host or [w] * bs
        extend = ForwardBatch(
            query_start=self.query_start[: bs + 1], seq_lens=self.seq_lens[:bs], block_tables=self.block_tables[:bs],
            slot_mapping=self.slot_mapping[: bs * w], logits_indices=self.last[:bs], block_size=self.block_size,
            max_query_len=w, max_seq_len=self.max_context, query_lens_host=[w] * bs, seq_lens_host=lens,
        )
        out = self.run_head(self.ids[: bs * w], self.hidden[: bs * w], self.positions[: bs * w], extend)
        state = out.index_select(0, self.last[:bs])
        tokens = self.draft(state)
        chain = [tokens]
        for j in range(self.k - 1):
            step = ForwardBatch(
                query_start=self.step_start[: bs + 1], seq_lens=self.chain_lens[j, :bs],
                block_tables=self.block_tables[:bs], slot_mapping=self.chain_slots[j, :bs],
                logits_indices=self.step_start[:bs].long(), block_size=self.block_size, max_query_len=1,
                max_seq_len=self.max_context, query_lens_host=[1] * bs,
                seq_lens_host=chain_lens_host[j] if chain_lens_host else [1] * bs,
            )
            state = self.run_head(tokens, state, self.chain_pos[j, :bs], step)
            tokens = self.draft(state)
            chain.append(tokens)
        return torch.stack(chain, dim=1)

    def capture(self) -> None:
        self._graphs, self._drafts = capture_buckets(self.buckets, self._forward, self.device,
                                                     f"MTP drafting ({self.k} drafts)")

    def bucket_for(self, num_seqs: int) -> Optional[int]:
        return next((b for b in self.buckets if b >= num_seqs), None)

    def stage(self, seqs: list, starts: list[int], kept: list[int], hidden: torch.Tensor,
              hidden_rows: list[int]) -> int:
        """Fill the static inputs: sequence ``i`` kept positions ``starts[i] ..`` (``kept[i]``
        of them, at most ``width``), whose target hidden rows start at ``hidden_rows[i]``."""
        num, w, bsz, dev = len(seqs), self.width, self.block_size, self.device
        bs = self.bucket_for(num)
        src, dst, ids, pos, slots, last = [], [], [], [], [], []
        table = torch.zeros(bs, self.max_blocks, dtype=torch.int32)
        lens = [w] * bs
        chain_pos = torch.zeros(self.chain_pos.shape[0], bs, dtype=torch.int64)
        chain_lens = torch.ones(self.chain_pos.shape[0], bs, dtype=torch.int64)
        chain_slots = torch.full((self.chain_pos.shape[0], bs), -1, dtype=torch.int64)

        def slot(pages: list[int], p: int) -> int:
            return pages[p // bsz] * bsz + p % bsz if p // bsz < len(pages) else -1

        for i, (seq, start, n, row) in enumerate(zip(seqs, starts, kept, hidden_rows)):
            pages = list(seq.block_table)
            table[i, : len(pages)] = torch.tensor(pages, dtype=torch.int32)
            src += range(row, row + n)
            dst += range(i * w, i * w + n)
            tokens = seq.token_ids[start + 1 : start + 1 + n]
            ids += tokens + [0] * (w - n)
            pos += [start + t for t in range(w)]
            slots += [slot(pages, start + t) if t < n else -1 for t in range(w)]
            last.append(i * w + n - 1)
            lens[i] = start + w  # row t sits at position start + t
            end = start + n - 1
            for j in range(self.k - 1):
                p = end + j + 1
                chain_pos[j, i], chain_lens[j, i], chain_slots[j, i] = p, p + 1, slot(pages, p)
        for i in range(num, bs):  # padding sequences: no KV writes, a one-key context
            ids += [0] * w
            pos += [0] * w
            slots += [-1] * w
            last.append(i * w)
        self.hidden.index_copy_(0, torch.tensor(dst, dtype=torch.int64, device=dev),
                                hidden.index_select(0, torch.tensor(src, dtype=torch.int64, device=dev)))
        self.ids[: bs * w].copy_(torch.tensor(ids, dtype=torch.int64), non_blocking=True)
        self.positions[: bs * w].copy_(torch.tensor(pos, dtype=torch.int64), non_blocking=True)
        self.slot_mapping[: bs * w].copy_(torch.tensor(slots, dtype=torch.int64), non_blocking=True)
        self.seq_lens[:bs].copy_(torch.tensor(lens, dtype=torch.int64), non_blocking=True)
        self.last[:bs].copy_(torch.tensor(last, dtype=torch.int64), non_blocking=True)
        self.block_tables[:bs].copy_(table, non_blocking=True)
        self.chain_pos[:, :bs].copy_(chain_pos, non_blocking=True)
        self.chain_lens[:, :bs].copy_(chain_lens, non_blocking=True)
        self.chain_slots[:, :bs].copy_(chain_slots, non_blocking=True)
        self._staged = (lens, chain_lens.tolist())
        return bs

    def replay(self, bucket: int, num: int) -> torch.Tensor:
        self._graphs[bucket].replay()
        return self._drafts[bucket][:num]

    def forward_staged(self, bucket: int, num: int) -> torch.Tensor:
        """The captured work run eagerly on the staged inputs (tests check staging on CPU)."""
        return self._forward(bucket, *self._staged)[:num]
