"""Turns a scheduled step into tensors, runs the model and samples.

Plain data (sequences, chunks) comes in; tensors live only here. Per-step metadata
is built with vectorised tensor ops, and the sampled ids cross to the host once.

:meth:`ModelRunner.launch` only queues the step and returns a
:class:`~ninfer.engine.pending_step.PendingStep`. A decode step may be launched *ahead*:
before the previous step's tokens reached the host, its sequences are one token further
along than their host state says, and that token's id is fed from the device.

Sequences that ask for prompt log probabilities also get logits for the rows of their
prompt chunk: the row at position ``p`` scores prompt token ``p + 1``. The prompt's last
row is the sampling row, whose own log probability covers the first output token.
"""

from __future__ import annotations

from typing import Mapping, Optional

import torch

from ninfer.engine.cuda_graph import CapturedHead, DecodeGraphs
from ninfer.engine.guided_masks import GuidedMasks
from ninfer.engine.pending_step import PendingStep, SampledRow
from ninfer.engine.sampler import Sampler, SamplerOutput
from ninfer.engine.sampling_metadata import SamplingMetadata
from ninfer.engine.scheduler import SchedulerOutput
from ninfer.engine.spec.device_rounds import DeviceRounds
from ninfer.engine.spec.scratch import VerifyScratch
from ninfer.engine.spec.verify_graphs import VerifyGraphs
from ninfer.engine.spec.verify_step import (
    plain_argmax, query_lens, raw_argmax_rows, sample_verify_rows, verify_rows_for, verify_width,
)
from ninfer.lora import LoraBatch, LoraRegistry
from ninfer.model.forward_batch import ForwardBatch


#: prompt rows scored per matmul: bounds the [rows, vocab] float32 logits of a long chunk
PROMPT_LOGPROB_ROWS = 512


class ModelRunner:
    """``graphs``: captured decode graphs, replayed for the decode steps they fit (None:
    every step runs eagerly); ``guided``: the mask source of guided rows
    (:class:`~ninfer.engine.guided_masks.GuidedMasks`; None: guided decoding is off)."""

    def __init__(
        self,
        model,
        block_size: int,
        device: torch.device,
        vocab_size: int,
        loras: Optional[LoraRegistry] = None,
        guided: Optional[GuidedMasks] = None,
        graphs: Optional[DecodeGraphs] = None,
        scratch: Optional[VerifyScratch] = None,
        keep_hidden: bool = False,
        verify_graphs: Optional[VerifyGraphs] = None,
        rounds: Optional[DeviceRounds] = None,
    ):
        self.model = model
        #: hand each step's hidden states to the pending step (a draft model reads them)
        self.keep_hidden = keep_hidden
        #: captured verify steps (speculative decoding on CUDA; None: verify runs eagerly)
        self.verify_graphs = verify_graphs
        #: greedy speculative rounds run whole on the device (None: the host drives every round)
        self.rounds = rounds
        #: per-position state rows of verify steps (hybrid families with speculation on)
        self.scratch = scratch
        self.loras = loras
        self.block_size = block_size
        self.device = device
        self.vocab_size = vocab_size
        self.sampler = Sampler()
        self.graphs = graphs
        self.guided = guided

    def _replayable(self, sched: SchedulerOutput, prompt_logprobs) -> bool:
        chunks = sched.chunks
        return (
            self.graphs is not None
            and not prompt_logprobs
            and all(c.num_tokens == 1 and c.sample for c in chunks)
            and self.graphs.bucket_for(len(chunks)) is not None
            and (not self.loras or all(c.seq.lora_slot == 0 for c in chunks))
        )

    def _replay(self, sched: SchedulerOutput, ahead_ids: Optional[torch.Tensor]) -> torch.Tensor:
        """Hidden rows of a replayed decode step, one per chunk (every chunk samples)."""
        seqs = [c.seq for c in sched.chunks]
        tables = [s.pages() for s in seqs]
        slots = [s.state_slot for s in seqs] if self.graphs.state_slots is not None else None
        if ahead_ids is not None:
            return self.graphs.run(ahead_ids, [s.num_computed_tokens + 1 for s in seqs], tables, slots)
        positions = [s.num_computed_tokens for s in seqs]
        tokens = [s.token_ids[p] for s, p in zip(seqs, positions)]
        return self.graphs.run(tokens, positions, tables, slots)

    def build_batch(
        self, sched: SchedulerOutput, ahead_ids: Optional[torch.Tensor] = None
    ) -> tuple[torch.Tensor, torch.Tensor, ForwardBatch]:
        """Input ids, positions and the batch; ``ahead_ids``: a decode step launched ahead
        (each sequence one token further along, whose id is on the device).

        In a verify step (some decode rows have drafts; they come first) each of those
        becomes a verify row of the same width, ``1 +`` the most drafts any row has:
        shorter rows are padded with copies of their last token, which are never
        accepted, and padding positions past a row's pages write no KV."""
        chunks = sched.chunks
        shift = 0 if ahead_ids is None else 1
        width = verify_width(sched)
        starts = [c.seq.num_computed_tokens + shift for c in chunks]
        q_lens = query_lens(sched)
        seq_lens = [s + n for s, n in zip(starts, q_lens)]
        input_ids: list[int] = []
        if ahead_ids is None:
            for c, s, n in zip(chunks, starts, q_lens):
                tokens = c.seq.token_ids[s : s + 1] + list(c.drafts) if c.drafts else c.seq.token_ids[s : s + n]
                input_ids += tokens + tokens[-1:] * (n - len(tokens))
        width_pages = max(len(c.seq.block_table) for c in chunks)
        tables = torch.zeros(len(chunks), width_pages, dtype=torch.int64)
        pages = torch.tensor([len(c.seq.block_table) for c in chunks], dtype=torch.int64)
        for i, c in enumerate(chunks):
            tables[i, : len(c.seq.block_table)] = torch.from_numpy(c.seq.pages())

        q_lens_t = torch.tensor(q_lens, dtype=torch.int64)
        query_start = torch.zeros(len(chunks) + 1, dtype=torch.int64)
        torch.cumsum(q_lens_t, 0, out=query_start[1:])
        row_seq = torch.repeat_interleave(torch.arange(len(chunks)), q_lens_t)
        offsets = torch.arange(sum(q_lens)) - query_start[row_seq]
        positions = torch.tensor(starts, dtype=torch.int64)[row_seq] + offsets
        bs = self.block_size
        page = positions // bs
        inside = page < pages[row_seq]  # only verify padding can reach past a row's pages
        slots = torch.where(inside, tables[row_seq, page.clamp(max=width_pages - 1)] * bs + positions % bs, -1)
        if width:  # every row of a verify chunk is scored, then the last of every other sampling chunk
            verify_rows = torch.arange(sched.num_verify * width)
            tail = [i for i, c in enumerate(chunks) if c.sample and i >= sched.num_verify]
            logits_indices = torch.cat([verify_rows, query_start[1:][tail] - 1])
        else:
            sample_rows = [i for i, c in enumerate(chunks) if c.sample]
            logits_indices = query_start[1:][sample_rows] - 1

        dev = self.device
        batch = ForwardBatch(
            query_start=query_start.to(dev, torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=tables.to(dev, torch.int32),
            slot_mapping=slots.to(dev),
            logits_indices=logits_indices.to(dev),
            block_size=bs,
            max_query_len=max(q_lens),
            max_seq_len=max(seq_lens),
            query_lens_host=q_lens,
            seq_lens_host=seq_lens,
        )
        if chunks[0].seq.state_slot is not None:  # the family keeps recurrent state
            state_slots = [c.seq.state_slot for c in chunks]
            batch.state_slots = torch.tensor(state_slots, dtype=torch.int64, device=dev)
            if width:
                batch.verify = verify_rows_for(batch, sched.num_verify, width, state_slots, self.scratch)
        # all verify rows: their attention may take the one-launch path, at the captured
        # width only (the warm-up compiled that one; a narrower step near the end of a
        # request's output would compile a kernel variant inside it)
        if width and sched.num_verify == len(chunks) and (self.verify_graphs is None
                                                          or width == self.verify_graphs.width):
            batch.rows_per_seq = width
        if self.loras:
            batch.lora = LoraBatch.build([c.seq.lora_slot for c in chunks], q_lens, dev)
        ids = ahead_ids if ahead_ids is not None else torch.tensor(input_ids, dtype=torch.int64).to(dev)
        return ids, positions.to(dev), batch

    @torch.inference_mode()
    def launch(
        self,
        sched: SchedulerOutput,
        prompt_logprobs: Optional[Mapping[int, int]] = None,
        ahead_ids: Optional[torch.Tensor] = None,
        draft_probs: Optional[Mapping[int, torch.Tensor]] = None,
    ) -> PendingStep:
        """Queue one step; nothing here waits for the device. Its :class:`PendingStep` gives
        one row per chunk with ``sample`` set, in order, and the prompt positions scored for
        the sequences in ``prompt_logprobs`` (seq id -> top-N).

        ``ahead_ids`` (int64 [B] on the device) launches a decode step ahead: every chunk
        is a decode row whose sequence is one token past its host state, and
        ``ahead_ids[i]`` is that token for chunk ``i``. ``draft_probs``: per seq id, the
        [drafts, vocab] distribution a verify row's drafts were drawn from (absent: greedy).
        """
        if self._replayable(sched, prompt_logprobs):
            # the graph's rows are the sampled rows already: no gather needed
            hidden = self._replay(sched, ahead_ids)
            head = self.graphs.last_head(len(sched.chunks))
            return self._kept(self._sample(sched, hidden, ahead_ids, head=head), hidden, 0)
        if self._on_device_round(sched, prompt_logprobs, draft_probs):
            return self._run_round(self.rounds.stage(sched), len(sched.chunks))
        if self._verify_replayable(sched, prompt_logprobs):
            width = self.verify_graphs.width
            hidden = self._replay_verify(sched, width)
            return self._kept(self._sample_verify(sched, hidden, {}, width, draft_probs), hidden, width)
        input_ids, positions, batch = self.build_batch(sched, ahead_ids)
        if batch.lora is None:
            hidden = self.model(input_ids, positions, batch)
        else:
            with self.loras.step(batch.lora):
                hidden = self.model(input_ids, positions, batch)
        prompt = self._score_prompt(sched, hidden, prompt_logprobs) if prompt_logprobs else {}
        width = verify_width(sched)
        if width:
            verdict = self._sample_verify(sched, hidden[batch.logits_indices], prompt, width, draft_probs)
            return self._kept(verdict, hidden, width)
        return self._kept(self._sample(sched, hidden[batch.logits_indices], ahead_ids, prompt), hidden, 0)

    @torch.inference_mode()
    def launch_round_ahead(self, sched: SchedulerOutput) -> PendingStep:
        """The device round after the last one of the same sequences, on the inputs that one
        left behind (its verdict need not have reached the host)."""
        return self._run_round(self.rounds.bucket_for(len(sched.chunks)), len(sched.chunks))

    def _run_round(self, bucket: int, num: int) -> PendingStep:
        packed, bank = self.rounds.run(bucket, num)
        return self._kept(PendingStep(None, [], {}).with_round(packed, self.rounds.width, bank), None,
                          self.rounds.width)

    def _on_device_round(self, sched: SchedulerOutput, prompt_logprobs, draft_probs) -> bool:
        """Whether ``sched`` runs as a device round (:mod:`ninfer.engine.spec.device_rounds`):
        verify rows only, each greedy on the raw argmax and unguided, no LoRA."""
        chunks = sched.chunks
        return (
            self.rounds is not None
            and not prompt_logprobs
            and not draft_probs
            and sched.num_verify == len(chunks)
            and 0 < verify_width(sched) <= self.rounds.width
            and self.rounds.bucket_for(len(chunks)) is not None
            and all(c.seq.num_computed_tokens + self.rounds.width <= len(c.seq.block_table) * self.block_size
                    for c in chunks)
            and all(plain_argmax(c.seq.sampling, c.seq.num_output_tokens) for c in chunks)
            and (self.guided is None or not any(self.guided.guides(c.seq.seq_id) for c in chunks))
            and (not self.loras or all(c.seq.lora_slot == 0 for c in chunks))
        )

    def _kept(self, pending: PendingStep, hidden: Optional[torch.Tensor], width: int) -> PendingStep:
        pending.hidden = hidden if self.keep_hidden else None
        pending.width = width
        return pending

    def _verify_replayable(self, sched: SchedulerOutput, prompt_logprobs) -> bool:
        graphs = self.verify_graphs
        bs = self.block_size
        return (
            graphs is not None
            and not prompt_logprobs
            and sched.num_verify == len(sched.chunks)
            and 0 < verify_width(sched) <= graphs.width
            # the graph pads every row to its full width: each must have the pages for it
            and all(c.seq.num_computed_tokens + graphs.width <= len(c.seq.block_table) * bs for c in sched.chunks)
            and graphs.bucket_for(len(sched.chunks)) is not None
            and (not self.loras or all(c.seq.lora_slot == 0 for c in sched.chunks))
        )

    def _replay_verify(self, sched: SchedulerOutput, width: int) -> torch.Tensor:
        """Hidden rows of a replayed verify step, ``width`` per chunk (drafts padded)."""
        seqs = [c.seq for c in sched.chunks]
        ids: list[int] = []
        for c in sched.chunks:
            row = c.seq.token_ids[c.seq.num_computed_tokens : c.seq.num_computed_tokens + 1] + list(c.drafts)
            ids += row + row[-1:] * (width - len(row))
        slots = [s.state_slot for s in seqs] if self.verify_graphs.scratch is not None else None
        return self.verify_graphs.run(ids, [s.num_computed_tokens for s in seqs], [s.pages() for s in seqs], slots)

    def _score_prompt(
        self, sched: SchedulerOutput, hidden: torch.Tensor, wanted: Mapping[int, int]
    ) -> dict[int, list[SampledRow]]:
        """Log probabilities of the next prompt token at every prompt row of the wanting chunks."""
        rows: list[int] = []
        targets: list[int] = []
        owners: list[tuple[int, int, int]] = []  # (seq id, top-N, number of rows)
        offset = 0
        for c in sched.chunks:
            seq, start = c.seq, c.seq.num_computed_tokens
            end = min(start + c.num_tokens, seq.num_prompt_tokens - 1)  # rows that predict a prompt token
            k = wanted.get(seq.seq_id)
            if k is not None and end > start:
                rows += range(offset, offset + end - start)
                targets += seq.token_ids[start + 1 : end + 1]
                owners.append((seq.seq_id, k, end - start))
            offset += c.num_tokens
        if not rows:
            return {}
        top_n = max(k for _, k, _ in owners)
        rows_t = torch.tensor(rows, dtype=torch.int64, device=self.device)
        targets_t = torch.tensor(targets, dtype=torch.int64, device=self.device)
        chosen, top_lps, top_ids = [], [], []
        for lo in range(0, len(rows), PROMPT_LOGPROB_ROWS):
            part = slice(lo, lo + PROMPT_LOGPROB_ROWS)
            lps = torch.log_softmax(self.model.compute_logits(hidden[rows_t[part]]).float(), dim=-1)
            chosen.append(lps.gather(1, targets_t[part, None]).squeeze(1))
            if top_n:
                values, ids = lps.topk(top_n, dim=-1)
                top_lps.append(values)
                top_ids.append(ids)
        chosen_h = torch.cat(chosen).tolist()
        top_lps_h = torch.cat(top_lps).tolist() if top_n else [[] for _ in rows]
        top_ids_h = torch.cat(top_ids).tolist() if top_n else [[] for _ in rows]
        out: dict[int, list[SampledRow]] = {}
        i = 0
        for seq_id, k, count in owners:
            out[seq_id] = [
                SampledRow(targets[j], chosen_h[j], top_ids_h[j][:k], top_lps_h[j][:k]) for j in range(i, i + count)
            ]
            i += count
        return out

    def _sample_verify(self, sched: SchedulerOutput, rows: torch.Tensor, prompt_rows, width: int,
                       draft_probs: Optional[Mapping[int, torch.Tensor]] = None) -> PendingStep:
        """A verify step (``width`` rows per verify chunk): the verify rows' verdict, then the
        other sampling rows (plain decode rows, prompts' last rows) sampled as usual."""
        n = sched.num_verify * width
        verify_chunks = sched.chunks[:sched.num_verify]
        # guided rows' masks at every verify position, filled while the device still runs
        token_mask = self.guided.verify_masks(verify_chunks, width) if self.guided else None
        verdict = sample_verify_rows(verify_chunks, width, self.model.compute_logits(rows[:n]), self.device,
                                     draft_probs, token_mask)
        plain = self._sample(sched, rows[n:], None, prompt_rows, skip=sched.num_verify)
        return plain.with_verdict(verdict, width)

    def _sample(self, sched: SchedulerOutput, sample_rows: torch.Tensor, ahead_ids: Optional[torch.Tensor],
                prompt_rows=None, skip: int = 0, head: Optional[CapturedHead] = None) -> PendingStep:
        """Sample from ``sample_rows``: the hidden rows of the chunks with ``sample`` set, in
        order (after the first ``skip`` chunks, which a verify step samples itself).
        ``ahead_ids``: a step launched ahead, whose rows' newest tokens are these (device).
        ``head``: the replayed graph's logits and argmax of these rows, when it captured them."""
        sampled = [c for c in sched.chunks[skip:] if c.sample]
        if not sampled:
            return PendingStep(None, [], prompt_rows or {})
        # guided rows' masks, filled on the host while the device still runs the forward pass
        token_mask = self.guided.masks([c.seq.seq_id for c in sampled]) if self.guided else None
        shift = int(ahead_ids is not None)
        settings = [c.seq.sampling for c in sampled]
        positions = [c.seq.num_output_tokens + shift for c in sampled]
        if head is not None and token_mask is None and raw_argmax_rows(settings, positions):
            # every row takes the raw argmax, which the graph computed already
            return PendingStep(SamplerOutput(token_ids=head.greedy_ids), [None] * len(sampled), prompt_rows or {})
        logits = head.logits if head is not None else self.model.compute_logits(sample_rows)
        # Token histories are only copied out when some row applies penalties.
        history = any(r.uses_penalties for r in settings)
        meta = SamplingMetadata.build(
            rows=settings,
            output_positions=positions,
            output_token_ids=[c.seq.output_array() if history else () for c in sampled],
            prompt_token_ids=[c.seq.prompt_array() if history else () for c in sampled],
            vocab_size=logits.shape[-1],
            device=self.device,
            token_mask=token_mask,
            pending_tokens=ahead_ids if history else None,  # every row of a step run ahead samples
        )
        out = self.sampler(logits, meta)
        return PendingStep(out, [c.seq.sampling.logprobs for c in sampled], prompt_rows or {})
