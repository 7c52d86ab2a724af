"""``--spec mtp``: drafts from the multi-token-prediction layer hybrid Qwen checkpoints ship.

After every target step the head extends its own KV over the positions the target kept
(each pairs the target's final hidden state with the token after it; see
:mod:`ninfer_plugins.models.mtp`), and for each row that may speculate next it chains
itself ``draft_tokens`` times from the last kept position: its first output gives draft
1, then each draft's embedding and the head's own output give the next. A request's
``proposal`` policy (the batch format's ``spec_proposal_sampling``) picks how: greedy
requests and "greedy" take the argmax of the draft logits (a one-hot q), sampled
requests under "auto" or "probabilistic" draw from the head's own distribution with the
request's temperature, top-k, top-p and min-p, and hand that q to verification. With
``--lm-head-draft`` the logits cover a vocabulary shortlist only (:mod:`.shortlist_head`).

The head's KV shares the target's page ids. A page that a later request reuses from the
prefix cache carries its draft KV along; the entry at a page's last position was
written with the original request's next token, so a reuser whose next token differs
drafts from a slightly wrong entry there. That can only cost acceptance, never
correctness: verification always runs the full target.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from loguru import logger
from ninfer_kernels import ops

from ninfer.capabilities import SpeculativeBackend
from ninfer.engine.sampling_metadata import SamplingMetadata
from ninfer.engine.spec.distribution import propose
from ninfer.engine.spec.shortlist import read_shortlist
from ninfer.hookspecs import hookimpl
from ninfer.model.forward_batch import ForwardBatch
from ninfer.model.interface import AttentionSpec
from ninfer_plugins.speculative.mtp_graphs import MtpGraphs, chain_drafts
from ninfer_plugins.speculative.shortlist_head import ShortlistHead


def _head(model):
    head = getattr(model, "mtp", None)
    if head is None:
        raise ValueError("speculative.backend mtp: this checkpoint has no MTP layer (no mtp.* weights)")
    return head


class MtpProposer:
    needs_hidden = True

    def __init__(self, ctx):
        self.model = ctx.model
        self.head = _head(ctx.model)
        for attn, cache in zip(self.head.attention_layers(), ctx.caches):
            attn.kv_cache = cache
        self.k = ctx.config.draft_tokens
        self.block_size = ctx.config.block_size
        self.max_batch, self.max_context = ctx.config.max_concurrency, ctx.config.max_context
        self.device = ctx.device
        self._drafts: dict[int, list[int]] = {}
        self._probs: dict[int, torch.Tensor] = {}
        spec = ctx.profile.speculative
        self.shortlist: Optional[ShortlistHead] = None
        if spec.lm_head_draft:
            ids = read_shortlist(ctx.model_dir, spec.lm_head_draft_size, ctx.vocab_size)
            self.shortlist = ShortlistHead(self.model.lm_head.weight, ids)
            logger.info("MTP drafts score a shortlist of {} of {} vocabulary entries", len(ids), ctx.vocab_size)
        self.graphs: Optional[MtpGraphs] = None
        if ctx.cuda_graphs and self.k > 0:
            self.graphs = self.make_graphs()
            self.graphs.capture()

    def make_graphs(self) -> MtpGraphs:
        """Static buffers for replayed drafting (captured on CUDA; tests stage them on CPU)."""
        weight = self.model.lm_head.weight
        return MtpGraphs(self._head_forward, self._greedy, weight.shape[1], weight.dtype, self.max_batch, self.k,
                         self.max_context, self.block_size, self.device)

    def _head_forward(self, ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, batch) -> torch.Tensor:
        return self.head(self.model.model.embed_tokens(ids), hidden, positions, batch, self.model.cos_sin)

    def _greedy(self, state: torch.Tensor) -> torch.Tensor:
        if self.shortlist is not None:
            return self.shortlist.argmax(state)
        return self.model.compute_logits(state).argmax(dim=-1)

    def _draft(self, state: torch.Tensor, seqs: list, step: int) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Draft ``step`` of each row from the head's output: its token, and the q it was
        drawn from (None when every row proposed greedily: verification reads one-hot)."""
        if all(s.proposal == "greedy" or s.sampling.greedy for s in seqs):
            return self._greedy(state), None
        logits = self._logits(state)
        dev, vocab = logits.device, logits.shape[-1]
        tokens = torch.empty(len(seqs), dtype=torch.int64, device=dev)
        probs = torch.empty(len(seqs), vocab, dtype=torch.float32, device=dev)
        for policy in sorted({s.proposal for s in seqs}):
            rows = [i for i, s in enumerate(seqs) if s.proposal == policy]
            index = torch.tensor(rows, dtype=torch.int64, device=dev)
            # the rows' own settings at the drafted position (penalties left out: q only
            # has to be the distribution the draft came from, not the target's)
            meta = SamplingMetadata.build([seqs[i].sampling for i in rows],
                                          [seqs[i].num_output_tokens + step for i in rows],
                                          [[] for _ in rows], [[] for _ in rows], vocab, dev)
            drawn = propose(logits.index_select(0, index), meta, policy)
            tokens[index] = drawn.token_ids
            q = drawn.probs
            if q is None:
                q = torch.zeros(len(rows), vocab, device=dev).scatter_(1, drawn.token_ids[:, None], 1.0)
            probs[index] = q
        return tokens, probs

    def _logits(self, state: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary draft logits; with the shortlist, -inf outside it."""
        if self.shortlist is None:
            return self.model.compute_logits(state)
        return self.shortlist.logits(state, self.model.lm_head.weight.shape[0])

    def _replayable(self, groups) -> bool:
        """Decode-shaped steps (every row kept at most ``k + 1`` positions) of greedy proposals."""
        return (
            self.graphs is not None
            and self.graphs.bucket_for(len(groups)) is not None
            and all(n <= self.graphs.width for _, _, n in groups)
            and all(s.proposal == "greedy" or s.sampling.greedy for s, _, _ in groups if s.is_decode)
        )

    def propose(self, seq, limit: int) -> list[int]:
        return self._drafts.pop(seq.seq_id, [])[:limit]

    def draft_probs(self, seq) -> Optional[torch.Tensor]:
        """[drafts, vocab]: the q the proposed drafts were drawn from (None: greedy)."""
        return self._probs.pop(seq.seq_id, None)

    def draft_after_round(self, hidden: torch.Tensor, tokens: torch.Tensor, accepted: torch.Tensor,
                          starts: torch.Tensor, tables: torch.Tensor, pages: torch.Tensor,
                          host_lists: bool = False) -> torch.Tensor:
        """Inside a device round (:mod:`ninfer.engine.spec.device_rounds`): extend the head
        over each row's kept positions and chain the next greedy drafts, [B, k], from device
        tensors only. Row ``b`` verified ``width`` positions from ``starts[b]`` (hidden rows
        ``b * width ..``), kept ``accepted[b] + 1`` of them, the tokens after them being
        ``tokens[b]``. ``host_lists``: also build the host lists the CPU kernels read."""
        ids, positions, slots, lens, last, chain_pos, chain_lens, chain_slots = ops.draft_chain_inputs(
            tokens, accepted, starts, tables, pages, self.block_size, self.k)
        return chain_drafts(
            self._head_forward, self._greedy, self.k, self.block_size, self.max_context, ids, hidden, positions,
            slots, lens, last, chain_pos, chain_lens, chain_slots, tables,
            lens.tolist() if host_lists else None, chain_lens.tolist() if host_lists else None,
        )

    @torch.inference_mode()
    def after_step(self, record) -> None:
        """Extend the head's KV over every kept position, then chain drafts for decode-ready
        rows (after a device round both happened on the device: only the drafts are kept)."""
        if record.next_drafts is not None:
            self._drafts.clear()
            self._probs.clear()
            for chunk, row in zip(record.chunks, record.next_drafts):
                if not chunk.seq.is_finished:
                    self._drafts[chunk.seq.seq_id] = row
            return
        if record.hidden is None:
            return
        rows, ids, positions, groups = [], [], [], []
        for chunk, start, first, kept in zip(record.chunks, record.starts, record.row_starts, record.kept):
            seq = chunk.seq
            if seq.is_finished or kept <= 0:
                continue
            rows += range(first, first + kept)
            ids += seq.token_ids[start + 1 : start + 1 + kept]
            positions += range(start, start + kept)
            groups.append((seq, start, kept))
        if not groups:
            return
        self._drafts.clear()
        self._probs.clear()
        if self._replayable(groups):
            rows = [first for chunk, start, first, kept in zip(record.chunks, record.starts, record.row_starts,
                                                                record.kept) if not chunk.seq.is_finished and kept > 0]
            seqs = [seq for seq, _, _ in groups]
            bucket = self.graphs.stage(seqs, [s for _, s, _ in groups], [n for _, _, n in groups], record.hidden,
                                       rows)
            for seq, row in zip(seqs, self.graphs.replay(bucket, len(seqs)).tolist()):
                if seq.is_decode:
                    self._drafts[seq.seq_id] = row
            return
        dev = record.hidden.device
        hidden = record.hidden.index_select(0, torch.tensor(rows, dtype=torch.int64, device=dev))
        out = self._run(ids, hidden, positions, groups)
        ends = torch.tensor([0, *self._cumsum([n for _, _, n in groups])], dtype=torch.int64, device=dev)[1:] - 1
        ready = [i for i, (seq, _, _) in enumerate(groups) if seq.is_decode]
        if not ready or self.k < 1:
            return
        pick = torch.tensor(ready, dtype=torch.int64, device=dev)
        state = out.index_select(0, ends.index_select(0, pick))
        seqs = [groups[i][0] for i in ready]
        last = [groups[i][1] + groups[i][2] - 1 for i in ready]  # the last kept position
        tokens, q = self._draft(state, seqs, 0)
        chain, qs = [tokens], [q]
        for j in range(1, self.k):
            pos = [p + j for p in last]
            state = self._run(tokens, state, pos, [(s, p, 1) for s, p in zip(seqs, pos)])
            tokens, q = self._draft(state, seqs, j)
            chain.append(tokens)
            qs.append(q)
        drafts = torch.stack(chain, dim=1).tolist()
        for i, (seq, row) in enumerate(zip(seqs, drafts)):
            self._drafts[seq.seq_id] = row
            if qs[0] is not None:
                self._probs[seq.seq_id] = torch.stack([q[i] for q in qs])

    @staticmethod
    def _cumsum(values: list[int]) -> list[int]:
        out, total = [], 0
        for v in values:
            total += v
            out.append(total)
        return out

    def _run(self, ids, hidden: torch.Tensor, positions: list[int], groups) -> torch.Tensor:
        """The head over rows of ``groups`` ((seq, first position, rows)): writes its KV, returns its output."""
        dev = hidden.device
        ids_t = ids if isinstance(ids, torch.Tensor) else torch.tensor(ids, dtype=torch.int64, device=dev)
        pos_t = torch.tensor(positions, dtype=torch.int64, device=dev)
        return self._head_forward(ids_t, hidden, pos_t, self._batch(groups, dev))

    def _batch(self, groups, dev) -> ForwardBatch:
        bs = self.block_size
        q_lens = [n for _, _, n in groups]
        tables = [list(seq.block_table) for seq, _, _ in groups]
        # a chained draft may run past its row's pages (drafts beyond the output budget are
        # never proposed): the table is zero-padded to cover it, and it writes no KV there
        width = max(max(len(t) for t in tables), max(-(-(first + n) // bs) for _, first, n in groups))
        table_t = torch.zeros(len(tables), width, dtype=torch.int32)
        for i, t in enumerate(tables):
            table_t[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
        slots, lens = [], []
        for (seq, first, n), table in zip(groups, tables):
            lens.append(first + n)
            for p in range(first, first + n):  # a chained draft past the row's pages writes nothing
                slots.append(table[p // bs] * bs + p % bs if p // bs < len(table) else -1)
        query_start = torch.tensor([0, *self._cumsum(q_lens)], dtype=torch.int32)
        return ForwardBatch(
            query_start=query_start.to(dev),
            seq_lens=torch.tensor(lens, dtype=torch.int32, device=dev),
            block_tables=table_t.to(dev),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            logits_indices=torch.zeros(0, dtype=torch.int64, device=dev),
            block_size=bs,
            max_query_len=max(q_lens),
            max_seq_len=max(lens),
            query_lens_host=list(q_lens),
            seq_lens_host=lens,
        )


def _attention_specs(model) -> list[AttentionSpec]:
    head = _head(model)
    return [AttentionSpec(a.num_kv_heads, a.head_dim) for a in head.attention_layers()]


MTP = SpeculativeBackend(
    name="mtp",
    description="the checkpoint's multi-token-prediction layer drafts (Qwen3-Next, Qwen3.5/3.6)",
    draft_tokens=(1, 5),
    factory=MtpProposer,
    attention_specs=_attention_specs,
    lm_head_draft=True,
    drafts_on_device=True,
)


@hookimpl
def register_speculative_backends(register: Callable[[SpeculativeBackend], None]) -> None:
    register(MTP)
