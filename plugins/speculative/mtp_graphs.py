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

import functools
from typing import Callable, Optional

import numpy as np
import torch

from ninfer.engine.cuda_graph import StagedInputs, buckets_up_to, capture_buckets
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
        c = max(k - 1, 1)  # chained steps after the extend (one unused slot when k = 1)
        self.hidden = torch.zeros(n * w, hidden_size, dtype=dtype, device=device)
        # the per-step inputs, then the rows to gather from the target's hidden states
        fields = [("ids", n * w), ("positions", n * w), ("slot_mapping", n * w), ("seq_lens", n), ("last", n),
                  ("chain_pos", c * n), ("chain_lens", c * n), ("chain_slots", c * n), ("src", n * w), ("dst", n * w)]
        self._inputs = StagedInputs(fields, n, self.max_blocks, device)
        self.ids, self.positions, self.slot_mapping, self.seq_lens, self.last, self.src, self.dst = (
            self._inputs.device(f) for f in ("ids", "positions", "slot_mapping", "seq_lens", "last", "src", "dst"))
        self.chain_pos, self.chain_lens, self.chain_slots = (
            self._inputs.device(f).view(c, n) for f in ("chain_pos", "chain_lens", "chain_slots"))
        self.slot_mapping.fill_(-1)
        self.seq_lens.fill_(w)
        self.last.copy_(torch.arange(n, device=device) * w)  # each sequence's last kept row
        self.chain_lens.fill_(1)
        self.chain_slots.fill_(-1)
        self.block_tables = self._inputs.block_tables
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._drafts: dict[int, torch.Tensor] = {}

    def _forward(self, bs: int, seq_lens_host: Optional[list[int]] = None,
                 chain_lens_host: Optional[list[list[int]]] = None) -> torch.Tensor:
        """The captured work for bucket ``bs``: [bs, k] draft tokens. Host lists are only
        read by the CPU reference kernels (tests run this eagerly on staged inputs)."""
        w = self.width
        return chain_drafts(
            self.run_head, self.draft, self.k, self.block_size, self.max_context, self.ids[: bs * w],
            self.hidden[: bs * w], self.positions[: bs * w], self.slot_mapping[: bs * w], self.seq_lens[:bs],
            self.last[:bs], self.chain_pos[:, :bs], self.chain_lens[:, :bs], self.chain_slots[:, :bs],
            self.block_tables[:bs], seq_lens_host, chain_lens_host,
        )

    def capture(self) -> None:
        self._graphs, self._drafts = capture_buckets(self.buckets, self._forward, self.device,
                                                     f"MTP drafting ({self.k} drafts)")

    def bucket_for(self, num_seqs: int) -> Optional[int]:
        return next((b for b in self.buckets if b >= num_seqs), None)

    def stage(self, seqs: list, starts: list[int], kept: list[int], hidden: torch.Tensor,
              hidden_rows: list[int]) -> int:
        """Fill the static inputs: sequence ``i`` kept positions ``starts[i] ..`` (``kept[i]``
        of them, at most ``width``), whose target hidden rows start at ``hidden_rows[i]``."""
        num, w, bsz, chained = len(seqs), self.width, self.block_size, self.chain_pos.shape[0]
        bs = self.bucket_for(num)
        inputs = self._inputs
        inputs.begin()
        start = np.fromiter(starts, dtype=np.int64, count=num)
        n_kept = np.fromiter(kept, dtype=np.int64, count=num)
        # the table covers every page a row or its chained drafts reach (zeros past a row's own)
        reach = int((start + n_kept - 1 + self.k).max()) // bsz + 1
        cols = min(self.max_blocks, max(reach, max(len(s.block_table) for s in seqs)))
        table = np.zeros((bs, cols), dtype=np.int64)
        pages = np.empty(num, dtype=np.int64)
        ids = inputs.host("ids", (bs, w))
        ids[:] = 0
        for i, (seq, s0, n) in enumerate(zip(seqs, starts, kept)):
            row = seq.block_table
            table[i, : len(row)] = row
            pages[i] = len(row)
            ids[i, :n] = seq.token_ids[s0 + 1 : s0 + 1 + n]
        t = np.arange(w)

        def kv_slot(p: np.ndarray) -> np.ndarray:  # -1 past a row's pages: such a position writes nothing
            page = p // bsz
            inside = page < pages.reshape((-1,) + (1,) * (p.ndim - 1))
            rows = np.arange(num).reshape((-1,) + (1,) * (p.ndim - 1))
            return np.where(inside, table[rows, np.minimum(page, cols - 1)] * bsz + p % bsz, -1)

        pos = inputs.host("positions", (bs, w))
        pos[:] = 0
        pos[:num] = start[:, None] + t
        slots = inputs.host("slot_mapping", (bs, w))
        slots[:] = -1
        slots[:num] = np.where(t < n_kept[:, None], kv_slot(pos[:num]), -1)
        lens = inputs.host("seq_lens", bs)
        lens[:] = w
        lens[:num] = start + w  # row t sits at position start + t
        last = inputs.host("last", bs)
        last[:] = np.arange(bs) * w
        last[:num] += n_kept - 1
        # [chained, all rows] as the device views are laid out; this bucket uses the first bs columns
        n = self.chain_pos.shape[1]
        chain_pos, chain_lens, chain_slots = (inputs.host(name, (chained, n))[:, :bs]
                                              for name in ("chain_pos", "chain_lens", "chain_slots"))
        chain_pos[:], chain_lens[:], chain_slots[:] = 0, 1, -1
        if self.k > 1:
            p = (start + n_kept)[:, None] + np.arange(self.k - 1)  # chained step j drafts at end + j + 1
            chain_pos[:, :num] = p.T
            chain_lens[:, :num] = p.T + 1
            chain_slots[:, :num] = kv_slot(p).T
        src, dst = inputs.host("src", n_kept.sum()), inputs.host("dst", n_kept.sum())
        src[:] = np.concatenate([np.arange(r, r + n) for r, n in zip(hidden_rows, kept)])
        dst[:] = np.concatenate([np.arange(i * w, i * w + n) for i, n in enumerate(kept)])
        inputs.send(table)
        rows = int(n_kept.sum())
        self.hidden.index_copy_(0, self.dst[:rows], hidden.index_select(0, self.src[:rows]))
        self._staged = (lens.tolist(), chain_lens.tolist())
        return bs

    def replay(self, bucket: int, num: int) -> torch.Tensor:
        self._graphs[bucket].replay()
        return self._drafts[bucket][:num]

    def forward_staged(self, bucket: int, num: int) -> torch.Tensor:
        """The captured work run eagerly on the staged inputs (tests check staging on CPU)."""
        return self._forward(bucket, *self._staged)[:num]


@functools.lru_cache(maxsize=None)
def _row_offsets(bs: int, w: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The extend's query starts (``w`` rows a sequence), a chained step's (one row) and its
    logit rows, for ``bs`` sequences. Made once per shape and only read: the eager runs
    before a capture (:func:`~ninfer.engine.cuda_graph.capture_buckets`) make them, so a
    replayed round launches no kernels for them (five of a k = 3 round's otherwise)."""
    one = torch.arange(bs + 1, dtype=torch.int32, device=device)
    return one * w, one, one[:bs].long()


def chain_drafts(run_head: Callable, draft: Callable, k: int, block_size: int, max_context: int, ids: torch.Tensor,
                 hidden: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, seq_lens: torch.Tensor,
                 last: torch.Tensor, chain_pos: torch.Tensor, chain_lens: torch.Tensor, chain_slots: torch.Tensor,
                 tables: torch.Tensor, seq_lens_host: Optional[list[int]] = None,
                 chain_lens_host: Optional[list[list[int]]] = None) -> torch.Tensor:
    """The head extended over ``width`` rows per sequence (``ids``/``hidden``/``positions``/
    ``slots`` flat, sequence-major; a row with slot -1 writes no KV), then chained ``k - 1``
    times from row ``last[i]`` of each: [bs, k] greedy drafts. Chained step ``j`` sits at
    ``chain_pos[j]`` with ``chain_lens[j]`` keys and writes ``chain_slots[j]``. Every input is
    a device tensor (CUDA-graph safe); the host lists serve the CPU reference kernels only."""
    bs = last.shape[0]
    w = ids.shape[0] // bs
    extend_starts, one, one_rows = _row_offsets(bs, w, ids.device)
    extend = ForwardBatch(
        query_start=extend_starts, seq_lens=seq_lens, block_tables=tables,
        slot_mapping=slots, logits_indices=last, block_size=block_size, max_query_len=w,
        max_seq_len=max_context, query_lens_host=[w] * bs, seq_lens_host=seq_lens_host or [w] * bs,
        rows_per_seq=w,
    )
    out = run_head(ids, hidden, positions, extend)
    state = out.index_select(0, last)
    tokens = draft(state)
    chain = [tokens]
    for j in range(k - 1):
        step = ForwardBatch(
            query_start=one, seq_lens=chain_lens[j], block_tables=tables, slot_mapping=chain_slots[j],
            logits_indices=one_rows, block_size=block_size, max_query_len=1, max_seq_len=max_context,
            query_lens_host=[1] * bs, seq_lens_host=chain_lens_host[j] if chain_lens_host else [1] * bs,
        )
        state = run_head(tokens, state, chain_pos[j], step)
        tokens = draft(state)
        chain.append(tokens)
    return torch.stack(chain, dim=1)
