"""The verify half of a speculative round inside one engine step.

A step in which some decode rows carry drafts is a verify step: each of those rows
becomes ``width`` consecutive rows at the head of the batch (its last committed token,
then its drafts, padded to the step's widest row), scored in the same forward as the
other decode rows and any prefill chunks scheduled beside them, which the plain sampler
samples as usual (so guided rows keep their masks and budgets their forced tokens). Here:
the width, the per-position layout recurrent layers need
(:class:`ninfer.model.forward_batch.VerifyRows`), and the verdict over the scored rows
(:func:`ninfer.engine.spec.acceptance.verify` on the sampler's processed distribution).
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Optional, Sequence

import numpy as np
import torch

from ninfer.engine.defaults import ResolvedSampling
from ninfer.engine.sampling_metadata import TokenMask, to_device
from ninfer.engine.spec.acceptance import Verdict, accept_greedy, verify
from ninfer.engine.spec.distribution import bonus_rows, processed_distribution, verify_metadata
from ninfer.engine.spec.scratch import VerifyScratch
from ninfer.model.forward_batch import ForwardBatch, VerifyRows


def verify_width(sched) -> int:
    """Rows per verify row in this step: the scheduler's width (padded to the engine's
    whole width where the rows' pages allow), else 1 + the most drafts any has; 0 for a
    plain step."""
    if not sched.num_verify:
        return 0
    most = max((len(c.drafts) for c in sched.chunks[: sched.num_verify]), default=0)
    return max(sched.verify_width, most + 1 if most else 0)


def query_lens(sched, width: Optional[int] = None) -> list[int]:
    """Rows each chunk takes in the step's flat layout (a verify row: the step's width,
    or ``width`` when a replayed graph padded it wider)."""
    width = verify_width(sched) if width is None else width
    return [width if width and i < sched.num_verify else c.num_tokens for i, c in enumerate(sched.chunks)]


def verify_rows_for(
    batch: ForwardBatch, num_seqs: int, width: int, slots: Sequence[int], scratch: Optional[VerifyScratch]
) -> VerifyRows:
    """The per-position layout of the batch's first ``num_seqs`` (verify) sequences."""
    if scratch is None or scratch.width < width:
        raise RuntimeError("a verify step of a model with recurrent state needs scratch rows for its width")
    dev = batch.seq_lens.device
    working = list(slots[:num_seqs])
    lens = batch.seq_lens_host[:num_seqs]
    head = dataclasses.replace(
        batch, query_start=torch.arange(num_seqs + 1, dtype=torch.int32, device=dev) * width,
        seq_lens=batch.seq_lens[:num_seqs], max_query_len=width, max_seq_len=max(lens),
        query_lens_host=[width] * num_seqs, seq_lens_host=lens, state_slots=batch.state_slots[:num_seqs],
        verify=None, lora=None,
    )
    rows = to_device(scratch.row_array(np.array(working, dtype=np.int64), width).tolist(), torch.int64, dev)
    return VerifyRows(num_seqs, width, head, rows, _rest(batch, num_seqs, width, slots))


def _rest(batch: ForwardBatch, num_seqs: int, width: int, slots: Sequence[int]) -> Optional[ForwardBatch]:
    """The batch of the sequences after the verify rows (other decode rows, prefill chunks), or None."""
    if len(batch.seq_lens_host) == num_seqs:
        return None
    dev = batch.seq_lens.device
    q_lens = batch.query_lens_host[num_seqs:]
    lens = batch.seq_lens_host[num_seqs:]
    start = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    torch.cumsum(torch.tensor(q_lens, dtype=torch.int32), 0, out=start[1:])
    return dataclasses.replace(
        batch, query_start=start.to(dev), seq_lens=torch.tensor(lens, dtype=torch.int32, device=dev),
        max_query_len=max(q_lens), max_seq_len=max(lens), query_lens_host=q_lens, seq_lens_host=lens,
        state_slots=torch.tensor(list(slots[num_seqs:]), dtype=torch.int64, device=dev), verify=None, lora=None,
        rows_per_seq=0,
    )


def sample_verify_rows(chunks, width: int, logits: torch.Tensor, device: torch.device,
                       draft_probs: Optional[Mapping[int, torch.Tensor]] = None,
                       token_mask: Optional[TokenMask] = None) -> Verdict:
    """The verdict of every verify chunk: ``logits`` [len(chunks) * width, V], chunk-major;
    ``draft_probs``: per seq id, the q its drafts were drawn from (absent: greedy, one-hot);
    ``token_mask``: the guided rows' masks and held stops, addressing these verify rows
    (:meth:`ninfer.engine.guided_masks.GuidedMasks.verify_masks`), so p is masked as the
    plain sampler's would be at each position."""
    k = width - 1
    drafts = [list(c.drafts) + [c.drafts[-1] if c.drafts else 0] * (k - len(c.drafts)) for c in chunks]
    # (copies through pinned memory: a plain copy would wait for the verify forward to finish)
    drafts_t = to_device(drafts, torch.int64, device)
    num_drafts = to_device([len(c.drafts) for c in chunks], torch.int64, device)
    settings = [c.seq.sampling for c in chunks]
    if token_mask is None and all(plain_argmax(c.seq.sampling, c.seq.num_output_tokens) for c in chunks):
        # p is the point mass on the raw argmax at every row: no sampling metadata needed
        return accept_greedy(drafts_t, num_drafts, logits.argmax(dim=-1).view(len(chunks), width))
    history = any(r.uses_penalties for r in settings)
    meta = verify_metadata(
        settings,
        [c.seq.num_output_tokens for c in chunks],
        [c.seq.output_array() if history else () for c in chunks],
        [c.seq.prompt_array() if history else () for c in chunks],
        drafts_t, num_drafts, logits.shape[-1], device, token_mask,
    )
    target = processed_distribution(logits.float(), meta, bonus_rows(num_drafts, len(chunks), k))
    q = _draft_q(chunks, drafts_t, logits.shape[-1], draft_probs) if draft_probs else None
    return verify(drafts_t, num_drafts, target, q)


def plain_argmax(row: ResolvedSampling, position: int) -> bool:
    """Whether the plain sampler takes the raw logits' argmax for ``row`` at output
    ``position`` and every later one: greedy, no bias or penalties, no stop ban left."""
    return (
        row.greedy and not row.uses_penalties and not row.logit_bias
        and not (row.stop_token_ids and position < row.min_tokens)
    )


def raw_argmax_rows(rows: Sequence[ResolvedSampling], positions: Sequence[int]) -> bool:
    """Whether the sampler's tokens for ``rows`` (at output ``positions``) are the raw logits'
    argmax, as a captured head computes it: every row plain greedy there, none asking for
    log probabilities. Guide masks are the caller's to rule out."""
    return all(row.logprobs is None and plain_argmax(row, pos) for row, pos in zip(rows, positions))


def _draft_q(chunks, drafts: torch.Tensor, vocab: int, draft_probs: Mapping[int, torch.Tensor]) -> torch.Tensor:
    """float32 [B, k, V]: each row's q, one-hot on its drafts where it proposed greedily
    (and on the padding, which is never accepted)."""
    q = torch.zeros(*drafts.shape, vocab, dtype=torch.float32, device=drafts.device)
    q.scatter_(2, drafts.unsqueeze(2), 1.0)
    for i, c in enumerate(chunks):
        probs = draft_probs.get(c.seq.seq_id)
        if probs is not None:
            n = min(len(c.drafts), probs.shape[0])
            q[i, :n] = probs[:n].float()
    return q
