"""The distributions speculative verification compares: the target's p and the draft's q.

Verification is lossless only if p is exactly what the plain sampler would draw from at
that row, so p is computed with the sampler's own processing (logit bias, penalties,
stop bans, guide masks, temperature, min_p, top_k, top_p: :func:`apply_logit_bias`,
:func:`apply_constraints`, :func:`filter_candidates`), never a restatement of it.

Verify rows: request b with k drafts owns rows ``b * (k + 1) + j`` for j = 0..k, at
output positions ``t_b + j``. Row j is scored with drafts 0..j-1 already in the output
history, so penalties must count them; :func:`with_draft_history` adds them on the
device (the drafts never visit the host), :func:`verify_metadata` builds such rows from
the host-side request state.
"""

from __future__ import annotations

from typing import Optional, Sequence

import attrs
import torch

from ninfer.engine.defaults import ResolvedSampling
from ninfer.engine.sampler import (
    Candidates,
    apply_constraints,
    apply_logit_bias,
    filter_candidates,
    select_tokens,
)
from ninfer.engine.sampling_metadata import SamplingMetadata, TokenMask

#: ``spec_proposal_sampling`` values (the batch input format)
PROPOSAL_POLICIES = ("auto", "greedy", "probabilistic")


@attrs.frozen(eq=False)
class TargetDistribution:
    """The processed distribution of R rows.

    ``probs`` float32 [R, V], greedy rows one-hot on their argmax; None when every row is
    greedy (nothing random to compare). ``token_ids`` int64: what the plain sampler takes
    at the rows listed in ``rows`` (int64 [N]), or at every row when ``rows`` is None; a
    round's bonus token is this token of row num_drafts, so a row whose valid drafts are
    all accepted samples its next token exactly as without speculation. All-greedy
    targets always carry every row's argmax (prefix matching needs them all).
    ``seeds`` / ``positions`` int64 [R] come from the metadata (None when all greedy).
    """

    token_ids: torch.Tensor
    probs: Optional[torch.Tensor] = None
    seeds: Optional[torch.Tensor] = None
    positions: Optional[torch.Tensor] = None
    rows: Optional[torch.Tensor] = None


@attrs.frozen(eq=False)
class Proposal:
    """One draft step: ``token_ids`` int64 [B] and ``probs`` float32 [B, V], the q they were
    drawn from (one-hot rows where proposed greedily); None when every row proposed
    greedily, which verification reads as q one-hot on the token."""

    token_ids: torch.Tensor
    probs: Optional[torch.Tensor] = None


def processed_distribution(
    logits: torch.Tensor, meta: SamplingMetadata, sample_rows: Optional[torch.Tensor] = None
) -> TargetDistribution:
    """float ``logits`` [R, V] -> the distribution the sampler draws each row from.

    ``sample_rows``: the rows whose plain-sampler token is wanted (for verification,
    :func:`bonus_rows`), so the per-token noise is hashed for B rows instead of B*(k+1);
    None = every row."""
    if tuple(logits.shape) != (meta.num_rows, meta.vocab_size):
        raise ValueError(f"logits {tuple(logits.shape)} do not match metadata ({meta.num_rows}, {meta.vocab_size})")
    logits = apply_constraints(apply_logit_bias(logits.float(), meta), meta)
    if meta.all_greedy:
        return TargetDistribution(logits.argmax(dim=-1))
    candidates = filter_candidates(logits, meta)
    token_ids = select_tokens(logits, meta, candidates, sample_rows)
    probs = candidate_probs(candidates, meta.vocab_size)
    if meta.greedy_mask is not None:
        one_hot = torch.zeros_like(probs).scatter_(1, logits.argmax(dim=-1, keepdim=True), 1.0)
        probs = torch.where(meta.greedy_mask.unsqueeze(1), one_hot, probs)
    return TargetDistribution(token_ids, probs, meta.seeds, meta.positions, sample_rows)


def bonus_rows(num_drafts: Optional[torch.Tensor], num_requests: int, k: int, device=None) -> torch.Tensor:
    """int64 [B]: the verify row each request's bonus token would come from,
    ``b * (k + 1) + num_drafts[b]`` (None = k drafts each)."""
    device = num_drafts.device if num_drafts is not None else device
    start = torch.arange(num_requests, device=device) * (k + 1)
    return start + (num_drafts if num_drafts is not None else k)


def candidate_probs(candidates: Candidates, vocab_size: int) -> torch.Tensor:
    """float32 [B, V]: ``softmax(candidates.values)`` laid out by token id.

    The softmax runs over the whole vocabulary in id order even when the candidates are a
    ranked slice: its reduction then never depends on the slice width, which is the
    batch's largest top-k, so a row's p is the same bits whatever shares its batch."""
    values = candidates.values
    if candidates.token_ids is not None:
        full = values.new_full((values.shape[0], vocab_size), -torch.inf)
        values = full.scatter(1, candidates.token_ids, values)
    return torch.softmax(values, dim=-1)


def propose(draft_logits: torch.Tensor, meta: SamplingMetadata, policy: str = "auto") -> Proposal:
    """One proposal per row from the draft's logits [B, V], under ``spec_proposal_sampling``.

    ``meta`` describes the rows at the drafted positions (the target's settings; its
    penalties may or may not count earlier drafts). Whatever processing it applies,
    verification stays exact because q is returned with the token it produced.
    "greedy": the argmax of the processed draft logits. "auto" and "probabilistic": a draw
    from the draft's own processed distribution (the row's temperature, min_p, top_k,
    top_p), on the sampler's (seed, position) stream; greedy target rows propose their
    argmax under every policy, because at their temperature the processed distribution
    is that point mass (a wider q could only lower acceptance). So "auto" and
    "probabilistic" coincide here; "greedy" differs on random rows, where a one-hot q
    makes a draft's acceptance p(x) (cheaper: no q to keep, usually fewer accepted).
    """
    if policy not in PROPOSAL_POLICIES:
        raise ValueError(f"spec_proposal_sampling must be one of {PROPOSAL_POLICIES}, not {policy!r}")
    if policy == "greedy" or meta.all_greedy:
        constrained = apply_constraints(apply_logit_bias(draft_logits.float(), meta), meta)
        return Proposal(constrained.argmax(dim=-1))
    dist = processed_distribution(draft_logits, meta)
    return Proposal(dist.token_ids, dist.probs)


def draft_history_counts(
    drafts: torch.Tensor, num_drafts: Optional[torch.Tensor], vocab_size: int
) -> torch.Tensor:
    """float32 [B, k+1, V]: entry ``[b, j, t]`` counts token t among drafts 0..j-1 of row b
    that are valid (index < ``num_drafts[b]``; None = all k). One scatter, no host sync;
    padding drafts (any value, -1 included) are never read as tokens."""
    b, k = drafts.shape
    device = drafts.device
    idx = torch.arange(k, device=device)
    valid = idx.unsqueeze(0) < (num_drafts.unsqueeze(1) if num_drafts is not None else k)
    ids = torch.where(valid, drafts.clamp(0, vocab_size - 1), vocab_size)  # [B, k]; V = "not counted"
    before = idx.unsqueeze(0) < torch.arange(k + 1, device=device).unsqueeze(1)  # [k+1, k]: i < j
    index = torch.where(before.unsqueeze(0), ids.unsqueeze(1), vocab_size)  # [B, k+1, k]
    counts = torch.zeros(b, k + 1, vocab_size + 1, dtype=torch.float32, device=device)
    counts.scatter_add_(2, index, torch.ones_like(index, dtype=torch.float32))
    return counts[..., :vocab_size]


def with_draft_history(
    meta: SamplingMetadata, drafts: torch.Tensor, num_drafts: Optional[torch.Tensor] = None
) -> SamplingMetadata:
    """Verify-row metadata (B*(k+1) rows, request-major) with each row's earlier drafts
    added to its output counts (presence / frequency penalties) and to its seen tokens
    (repetition penalty). Metadata without penalties comes back unchanged."""
    if meta.output_counts is None and meta.repetition_mask is None:
        return meta
    b, k = drafts.shape
    if meta.num_rows != b * (k + 1):
        raise ValueError(f"{meta.num_rows} rows are not {b} requests of {k + 1} verify rows")
    extra = draft_history_counts(drafts, num_drafts, meta.vocab_size).reshape(meta.num_rows, meta.vocab_size)
    fields: dict = {}
    if meta.output_counts is not None:
        fields["output_counts"] = meta.output_counts + extra
    if meta.repetition_mask is not None:
        fields["repetition_mask"] = meta.repetition_mask | (extra > 0)
    return attrs.evolve(meta, **fields)


def verify_metadata(
    rows: Sequence[ResolvedSampling],
    output_positions: Sequence[int],
    output_token_ids: Sequence[Sequence[int]],
    prompt_token_ids: Sequence[Sequence[int]],
    drafts: torch.Tensor,
    num_drafts: Optional[torch.Tensor],
    vocab_size: int,
    device: torch.device | str,
    token_mask: Optional[TokenMask] = None,
) -> SamplingMetadata:
    """Metadata for the k+1 verify rows of each of B requests (k = ``drafts.shape[1]``).

    Per request: its settings, its history before the round and ``output_positions[b]``
    (the position of draft 0), as for :meth:`SamplingMetadata.build`. Row j sits at
    position ``t_b + j``, so min_tokens stop bans follow the position. ``token_mask``
    must already address verify rows (a guide's mask at row j is its state after drafts
    0..j-1, which only the caller can advance)."""
    width = drafts.shape[1] + 1
    repeat = lambda values: [v for v in values for _ in range(width)]  # noqa: E731
    positions = [t + j for t in output_positions for j in range(width)]
    meta = SamplingMetadata.build(
        repeat(rows), positions, repeat(output_token_ids), repeat(prompt_token_ids), vocab_size, device, token_mask
    )
    return with_draft_history(meta, drafts, num_drafts)
