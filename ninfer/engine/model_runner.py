"""Turns a scheduled step into tensors, runs the model and samples.

Plain data (sequences, chunks) comes in; tensors live only here. Per-step metadata
is built with vectorised tensor ops, and the sampled ids cross to the host once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ninfer.engine.sampler import Sampler
from ninfer.engine.sampling_metadata import SamplingMetadata
from ninfer.engine.scheduler import SchedulerOutput
from ninfer.lora import LoraBatch, LoraRegistry
from ninfer.model.forward_batch import ForwardBatch


@dataclass
class SampledRow:
    token_id: int
    logprob: Optional[float] = None
    top_ids: Optional[list[int]] = None
    top_logprobs: Optional[list[float]] = None


class ModelRunner:
    def __init__(
        self, model, block_size: int, device: torch.device, vocab_size: int, loras: Optional[LoraRegistry] = None
    ):
        self.model = model
        self.loras = loras
        self.block_size = block_size
        self.device = device
        self.vocab_size = vocab_size
        self.sampler = Sampler()

    def build_batch(self, sched: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor, ForwardBatch]:
        chunks = sched.chunks
        starts = [c.seq.num_computed_tokens for c in chunks]
        q_lens = [c.num_tokens for c in chunks]
        seq_lens = [s + n for s, n in zip(starts, q_lens)]
        input_ids: list[int] = []
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
        offsets = torch.arange(len(input_ids)) - query_start[row_seq]
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
        if self.loras:
            batch.lora = LoraBatch.build([c.seq.lora_slot for c in chunks], q_lens, dev)
        ids = torch.tensor(input_ids, dtype=torch.int64).to(dev)
        return ids, positions.to(dev), batch

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> list[SampledRow]:
        """Run one step; returns one row per chunk with ``sample`` set, in order."""
        input_ids, positions, batch = self.build_batch(sched)
        if batch.lora is None:
            hidden = self.model(input_ids, positions, batch)
        else:
            with self.loras.step(batch.lora):
                hidden = self.model(input_ids, positions, batch)
        sampled = [c for c in sched.chunks if c.sample]
        if not sampled:
            return []
        logits = self.model.compute_logits(hidden[batch.logits_indices])
        settings = [c.seq.sampling for c in sampled]
        # Token histories are only copied out when some row applies penalties.
        history = any(r.uses_penalties for r in settings)
        meta = SamplingMetadata.build(
            rows=settings,
            output_positions=[c.seq.num_output_tokens for c in sampled],
            output_token_ids=[c.seq.output_token_ids if history else [] for c in sampled],
            prompt_token_ids=[c.seq.token_ids[: c.seq.num_prompt_tokens] if history else [] for c in sampled],
            vocab_size=logits.shape[-1],
            device=self.device,
        )
        out = self.sampler(logits, meta)
        token_ids = out.token_ids.tolist()  # the step's one host sync
        if out.top_ids is None:
            return [SampledRow(t) for t in token_ids]
        lps, top_ids, top_lps = out.logprobs.tolist(), out.top_ids.tolist(), out.top_logprobs.tolist()
        rows = []
        for i, (c, t) in enumerate(zip(sampled, token_ids)):
            k = c.seq.sampling.logprobs
            if k is None:
                rows.append(SampledRow(t))
            else:
                rows.append(SampledRow(t, lps[i], top_ids[i][:k], top_lps[i][:k]))
        return rows
