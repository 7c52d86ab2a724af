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

from ninfer.engine.cuda_graph import DecodeGraphs
from ninfer.engine.guided_masks import GuidedMasks
from ninfer.engine.pending_step import PendingStep, SampledRow
from ninfer.engine.sampler import Sampler
from ninfer.engine.sampling_metadata import SamplingMetadata
from ninfer.engine.scheduler import SchedulerOutput
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
    ):
        self.model = model
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
        tables = [s.block_table for s in seqs]
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
        (each sequence one token further along, whose id is on the device)."""
        chunks = sched.chunks
        shift = 0 if ahead_ids is None else 1
        starts = [c.seq.num_computed_tokens + shift for c in chunks]
        q_lens = [c.num_tokens for c in chunks]
        seq_lens = [s + n for s, n in zip(starts, q_lens)]
        input_ids: list[int] = []
        if ahead_ids is None:
            for c, s, n in zip(chunks, starts, q_lens):
                input_ids += c.seq.token_ids[s : s + n]
        width = max(len(c.seq.block_table) for c in chunks)
        tables = torch.zeros(len(chunks), width, dtype=torch.int64)
        for i, c in enumerate(chunks):
            tables[i, : len(c.seq.block_table)] = torch.tensor(c.seq.block_table, dtype=torch.int64)

        q_lens_t = torch.tensor(q_lens, dtype=torch.int64)
        query_start = torch.zeros(len(chunks) + 1, dtype=torch.int64)
        torch.cumsum(q_lens_t, 0, out=query_start[1:])
        row_seq = torch.repeat_interleave(torch.arange(len(chunks)), q_lens_t)
        offsets = torch.arange(sum(q_lens)) - query_start[row_seq]
        positions = torch.tensor(starts, dtype=torch.int64)[row_seq] + offsets
        bs = self.block_size
        slots = tables[row_seq, positions // bs] * bs + positions % bs
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
            batch.state_slots = torch.tensor([c.seq.state_slot for c in chunks], dtype=torch.int64, device=dev)
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
    ) -> PendingStep:
        """Queue one step; nothing here waits for the device. Its :class:`PendingStep` gives
        one row per chunk with ``sample`` set, in order, and the prompt positions scored for
        the sequences in ``prompt_logprobs`` (seq id -> top-N).

        ``ahead_ids`` (int64 [B] on the device) launches a decode step ahead: every chunk
        is a decode row whose sequence is one token past its host state, and
        ``ahead_ids[i]`` is that token for chunk ``i``.
        """
        if self._replayable(sched, prompt_logprobs):
            # the graph's rows are the sampled rows already: no gather needed
            return self._sample(sched, self._replay(sched, ahead_ids), ahead_ids is not None)
        input_ids, positions, batch = self.build_batch(sched, ahead_ids)
        if batch.lora is None:
            hidden = self.model(input_ids, positions, batch)
        else:
            with self.loras.step(batch.lora):
                hidden = self.model(input_ids, positions, batch)
        prompt = self._score_prompt(sched, hidden, prompt_logprobs) if prompt_logprobs else {}
        return self._sample(sched, hidden[batch.logits_indices], ahead_ids is not None, prompt)

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

    def _sample(self, sched: SchedulerOutput, sample_rows: torch.Tensor, ahead: bool, prompt_rows=None) -> PendingStep:
        """Sample from ``sample_rows``: the hidden rows of the chunks with ``sample`` set, in order."""
        sampled = [c for c in sched.chunks if c.sample]
        if not sampled:
            return PendingStep(None, [], prompt_rows or {})
        # guided rows' masks, filled on the host while the device still runs the forward pass
        token_mask = self.guided.masks([c.seq.seq_id for c in sampled]) if self.guided else None
        logits = self.model.compute_logits(sample_rows)
        settings = [c.seq.sampling for c in sampled]
        # Token histories are only copied out when some row applies penalties.
        history = any(r.uses_penalties for r in settings)
        meta = SamplingMetadata.build(
            rows=settings,
            output_positions=[c.seq.num_output_tokens + int(ahead) for c in sampled],
            output_token_ids=[c.seq.output_token_ids if history else [] for c in sampled],
            prompt_token_ids=[c.seq.token_ids[: c.seq.num_prompt_tokens] if history else [] for c in sampled],
            vocab_size=logits.shape[-1],
            device=self.device,
            token_mask=token_mask,
        )
        out = self.sampler(logits, meta)
        return PendingStep(out, [c.seq.sampling.logprobs for c in sampled], prompt_rows or {})
