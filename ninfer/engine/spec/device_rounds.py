"""Greedy speculative rounds that run on the device from end to end, and feed the next one.

A round as the host drives it waits twice: for the verdict (how many drafts stand), and
then for the drafter's next proposals, built from what the verdict kept. On a model whose
step takes the device a millisecond or less, those waits and the host work around them
cost more than the forward passes. For greedy rows nothing in a round needs the host,
so one captured graph per batch bucket holds all of it:

1. the verify forward over ``width`` rows per sequence (:class:`VerifyGraphs`' inputs),
   the LM head and its argmax;
2. the verdict (``ops.round_verdict``: :func:`~ninfer.engine.spec.acceptance.accept_greedy`'s rule);
3. the working recurrent-state slot takes the scratch row of the last kept position
   (what :meth:`VerifyScratch.settle` does from the host otherwise);
4. the proposer's drafting over the kept positions (a backend offers
   ``draft_after_round``; the MTP head does);
5. the next round's inputs, written over this round's (``ops.round_advance``): the
   target's token and the new drafts as token ids, positions moved on by the tokens
   kept, their KV slots.

Replaying the same bucket again therefore runs the next round with no host input at all,
which is how the engine launches a round before the previous one's verdict reached the
host (:func:`plan_round_ahead`). Every result (drafts kept, tokens, the next drafts)
crosses to the host in one copy, so steps staged from the host in between (a batch that
changed) find the proposals where they expect them.

The price of a round launched ahead is a round of wasted work when the previous one ends
its request (a stop token), as for decode steps launched ahead. Rows whose next tokens
depend on host state (guided, penalties, sampled, log probabilities, thinking budgets)
never run here; they take the host-driven round.
"""

from __future__ import annotations

import os
from typing import Callable, Optional

import torch
from ninfer_kernels import ops

from ninfer.engine.cuda_graph import capture_buckets
from ninfer.engine.scheduler import ScheduledChunk, Scheduler, SchedulerOutput
from ninfer.engine.spec.acceptance import PAD_TOKEN
from ninfer.engine.spec.scratch import VerifyScratch
from ninfer.engine.spec.verify_graphs import VerifyGraphs


def device_rounds_enabled() -> bool:
    """``NINFER_DEVICE_ROUNDS=0`` keeps every round on the host (for comparisons)."""
    return os.environ.get("NINFER_DEVICE_ROUNDS", "1") != "0"


class DeviceRounds:
    """Rounds of ``verify.width`` rows per sequence, captured per bucket (``capture``) or,
    on CPU where tests run them, executed eagerly on the same static inputs.

    ``draft(hidden, tokens, accepted, starts, tables, pages, host_lists)`` is the proposer's
    ``draft_after_round``: [B, k] greedy drafts to follow each row's kept tokens."""

    def __init__(self, model, verify: VerifyGraphs, draft: Callable, scratch: Optional[VerifyScratch]):
        self.model, self.verify, self.draft, self.scratch = model, verify, draft, scratch
        self.width, self.k = verify.width, verify.width - 1
        #: scratch rows in two banks: each round leaves the next one the other bank
        self.banked = scratch is not None and scratch.banks == 2
        self._bank = 0  # the bank the static inputs point the next round at
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, torch.Tensor] = {}

    def capture(self) -> None:
        self._graphs, self._outputs = capture_buckets(self.verify.buckets, self._round, self.verify.device,
                                                      f"greedy speculative rounds (width {self.width})")

    def bucket_for(self, num_seqs: int) -> Optional[int]:
        return self.verify.bucket_for(num_seqs)

    def stage(self, sched: SchedulerOutput) -> int:
        """Fill the static inputs from the host's view of ``sched`` (every chunk a verify
        row); returns the bucket."""
        w = self.width
        ids: list[int] = []
        for c in sched.chunks:
            row = c.seq.token_ids[c.seq.num_computed_tokens : c.seq.num_computed_tokens + 1] + list(c.drafts)
            ids += row + row[-1:] * (w - len(row))
        seqs = [c.seq for c in sched.chunks]
        slots = [s.state_slot for s in seqs] if self.scratch is not None else None
        self._bank = 0  # staging points at bank 0
        return self.verify.stage_inputs(ids, [s.num_computed_tokens for s in seqs], [s.pages() for s in seqs],
                                        slots, [len(c.drafts) for c in sched.chunks])

    def run(self, bucket: int, num: int) -> tuple[torch.Tensor, int]:
        """One round on whatever the static inputs hold: (int64 [num, 1 + width + k], per row
        the drafts kept, the committed tokens (padded with PAD_TOKEN) and the next drafts;
        the scratch bank the round wrote its per-position states to)."""
        bank = self._bank
        self._bank ^= int(self.banked)
        graph = self._graphs.get(bucket)
        if graph is None:  # not captured (CPU): the same work, eagerly
            return self._round(bucket, host_lists=True)[:num], bank
        graph.replay()
        return self._outputs[bucket][:num], bank

    @torch.inference_mode()
    def _round(self, bs: int, host_lists: bool = False) -> torch.Tensor:
        v, w = self.verify, self.width
        batch = v.batch(bs, v.seq_lens[:bs].tolist() if host_lists else None)
        ids = v.input_ids[: bs * w]
        hidden = self.model(ids, v.positions[: bs * w], batch)
        target = self.model.compute_logits(hidden).argmax(dim=-1).view(bs, w)
        rows = v.position_rows[:bs] if self.scratch is not None else None
        accepted, tokens, kept = ops.round_verdict(ids, v.num_drafts[:bs], target, rows)
        if self.scratch is not None:  # padding rows copy their trash row onto itself: nothing
            ops.copy_state_rows(self.scratch.pools, kept, v.state_slots[:bs])
        starts = v.positions.view(-1, w)[:bs, 0]
        pages, tables = v.pages[:bs], v.block_tables[:bs]
        drafts = self.draft(hidden, tokens, accepted, starts, tables, pages, host_lists)
        # the next round's inputs over this one's (padding rows, without pages, stay inert);
        # banked scratch rows flip so that it writes the other bank
        return ops.round_advance(
            tokens, accepted, drafts, v.input_ids, v.positions, v.slot_mapping, v.seq_lens, v.num_drafts, pages,
            tables, v.block_size, rows, self.scratch.first_row if self.banked else 0,
            self.scratch.bank_rows if self.banked else 0)


def plan_round_ahead(sched: SchedulerOutput, scheduler: Scheduler, max_context: int, width: int,
                     banked: bool) -> Optional[SchedulerOutput]:
    """The round to launch behind device round ``sched`` (before its verdict reached the
    host), or None. It may run only when nothing about it depends on that verdict on the
    host: the same sequences, every one with room for two whole rounds (so the next has
    all its drafts and never passes its pages), and nobody waiting who could be admitted.
    Unless the scratch rows are ``banked``, no state snapshot may be due inside ``sched``
    either (it copies scratch rows the next round would overwrite). The chunks' drafts
    are placeholders: the real ones are on the device."""
    chunks = sched.chunks
    if sched.num_verify != len(chunks) or len(chunks) != scheduler.num_running:
        return None
    if scheduler.num_waiting and scheduler.num_running < scheduler.max_concurrency:
        return None
    if not banked and scheduler.captures_after(sched):
        return None
    for c in chunks:
        seq = c.seq
        room = min(seq.max_tokens - seq.num_output_tokens, max_context - seq.num_tokens)
        if seq.is_finished or room < 2 * width:
            return None
    # k placeholders stand for the k real drafts (room for two rounds means every row has
    # all of them), so the round's statistics count what was drafted
    ahead = [ScheduledChunk(c.seq, width, True, (PAD_TOKEN,) * (width - 1)) for c in chunks]
    return SchedulerOutput(chunks=ahead, num_decode=len(ahead), num_verify=len(ahead))
