"""Which drafts a round keeps, and the one token the target adds (Leviathan et al. 2023,
Chen et al. 2023).

Draft i (output position t+i) is accepted with probability min(1, p_i(x)/q_i(x)); at the
first rejection the target's token is drawn from norm(max(0, p_i - q_i)); when every valid
draft is accepted the bonus token is drawn from p_n. Then every committed token is
distributed exactly as plain sampling from p would be. Greedy targets reduce to the
longest prefix matching the target's argmax, plus the argmax after it.

Randomness is a pure function of (seed, absolute output position): the accept test reads
stream ACCEPT_STREAM at t+i, the residual draw DRAW_STREAM at the rejected position, the
bonus is the plain sampler's own draw (stream 0) at t+n, and proposals
(:func:`~ninfer.engine.spec.distribution.propose`) read stream 0 at their positions. So
the proposal, the test and the correction of one position are independent, as exactness
needs, and nothing depends on the batch or slot. A round that commits through position
t+a used only noise at positions <= t+a; what it computed beyond (a padding proposal at
t+n, tests after the first rejection) was thrown away, so the next round, starting at
t+a+1, meets fresh noise (the stopping-time argument). With a draft equal to the target,
or with no drafts, a seeded row commits the very tokens plain sampling would.

Everything is fixed-shape tensor work with no host syncs (CUDA-graph safe).
"""

from __future__ import annotations

from typing import Optional

import attrs
import torch

from ninfer.engine.sampler import gumbel_noise, row_keys, uniform_noise
from ninfer.engine.spec.distribution import TargetDistribution, bonus_rows

#: stream ids (signed 64-bit) for :func:`~ninfer.engine.sampler.row_keys`; 0 is the sampler's
ACCEPT_STREAM = 0x5A17_AC0E_7E57_0001
DRAW_STREAM = 0x5A17_D3A3_0BAD_0002
#: what :class:`Verdict` puts after the committed tokens
PAD_TOKEN = -1


@attrs.frozen(eq=False)
class Verdict:
    """``accepted`` int64 [B]: drafts kept (at most the row's valid drafts). ``token_ids``
    int64 [B, k+1]: the kept drafts, then the target's token, then PAD_TOKEN."""

    accepted: torch.Tensor
    token_ids: torch.Tensor

    @property
    def num_committed(self) -> torch.Tensor:
        return self.accepted + 1


def verify(
    drafts: torch.Tensor,
    num_drafts: Optional[torch.Tensor],
    target: TargetDistribution,
    draft_probs: Optional[torch.Tensor] = None,
) -> Verdict:
    """One round's verdict from the target's verify rows.

    ``drafts`` int64 [B, k]; ``num_drafts`` int64 [B] valid drafts per row (None = k;
    padding never accepts); ``target`` over the B*(k+1) verify rows, request-major, with
    row j of request b at output position ``t_b + j`` (its tokens drawn at every row, or
    at :func:`bonus_rows` only); ``draft_probs`` float32 [B, k, V],
    the q each draft was drawn from (None: proposed greedily, q one-hot). An all-greedy
    target takes the argmax-matching path whatever q was.
    """
    b, k = drafts.shape
    if target.probs is None:
        return accept_greedy(drafts, num_drafts, target.token_ids.view(b, k + 1))
    if target.rows is None:
        rows = bonus_rows(num_drafts, b, k, drafts.device)
        bonus = target.token_ids.index_select(0, rows)
    else:
        bonus = target.token_ids  # drawn at bonus_rows (processed_distribution's sample_rows)
    start = lambda t: t.view(b, k + 1)[:, 0]  # noqa: E731
    probs = target.probs.view(b, k + 1, -1)
    return accept_sampled(drafts, num_drafts, probs, draft_probs, bonus, start(target.seeds), start(target.positions))


def accept_greedy(drafts: torch.Tensor, num_drafts: Optional[torch.Tensor], target_ids: torch.Tensor) -> Verdict:
    """Greedy target rows: ``target_ids`` int64 [B, k+1] are the argmaxes of the verify rows."""
    k = drafts.shape[1]
    match = (drafts == target_ids[:, :k]) & _valid(drafts, num_drafts)
    accepted = match.long().cumprod(dim=1).sum(dim=1)
    return _commit(drafts, accepted, target_ids.gather(1, accepted.unsqueeze(1)).squeeze(1))


def accept_sampled(
    drafts: torch.Tensor,
    num_drafts: Optional[torch.Tensor],
    target_probs: torch.Tensor,
    draft_probs: Optional[torch.Tensor],
    bonus_ids: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
) -> Verdict:
    """Random (or mixed) target rows.

    ``target_probs`` float32 [B, k+1, V] (greedy rows one-hot); ``bonus_ids`` int64 [B]
    the plain sampler's token at verify row ``num_drafts[b]``; ``seeds`` int64 [B];
    ``positions`` int64 [B], the output position of draft 0.
    """
    b, k = drafts.shape
    vocab = target_probs.shape[-1]
    device = drafts.device
    valid = _valid(drafts, num_drafts)
    safe = drafts.clamp(0, vocab - 1)  # padding may hold anything; its test is masked off
    p_x = target_probs[:, :k].gather(2, safe.unsqueeze(2)).squeeze(2)
    q_x = torch.ones_like(p_x) if draft_probs is None else draft_probs.gather(2, safe.unsqueeze(2)).squeeze(2)
    offsets = torch.arange(k, device=device)
    accept_keys = row_keys(seeds.unsqueeze(1), positions.unsqueeze(1) + offsets, ACCEPT_STREAM)
    u = uniform_noise(accept_keys.reshape(-1), torch.zeros(1, 1, dtype=torch.int64, device=device)).view(b, k)
    # u < p/q without dividing: p >= q always accepts; u is in (0, 1), so p = 0 never does
    ok = valid & ((p_x >= q_x) | (u * q_x.double() < p_x.double()))
    accepted = ok.long().cumprod(dim=1).sum(dim=1)
    if k == 0:
        return _commit(drafts, accepted, bonus_ids)

    at = accepted.clamp(max=k - 1)  # the rejected draft, where there is one
    p_at = target_probs.gather(1, at.view(b, 1, 1).expand(b, 1, vocab)).squeeze(1)
    if draft_probs is None:
        # q one-hot on the draft: the residual is p without the draft token
        residual = p_at.scatter(1, safe.gather(1, at.unsqueeze(1)), 0.0)
    else:
        q_at = draft_probs.gather(1, at.view(b, 1, 1).expand(b, 1, vocab)).squeeze(1)
        residual = (p_at - q_at).clamp_min(0.0)
    # rounding can leave nothing where p and q nearly agree; p itself is then the right law
    residual = torch.where(residual.sum(dim=1, keepdim=True) > 0, residual, p_at)
    draw_keys = row_keys(seeds, positions + at, DRAW_STREAM)
    ids = torch.arange(vocab, device=device).unsqueeze(0)
    redraw = (residual.log() + gumbel_noise(draw_keys, ids)).argmax(dim=1)
    rejected = accepted < (num_drafts if num_drafts is not None else k)
    return _commit(drafts, accepted, torch.where(rejected, redraw, bonus_ids))


def _valid(drafts: torch.Tensor, num_drafts: Optional[torch.Tensor]) -> torch.Tensor:
    """bool [B, k] (or [1, k] when every draft is valid)."""
    idx = torch.arange(drafts.shape[1], device=drafts.device).unsqueeze(0)
    return idx < (num_drafts.unsqueeze(1) if num_drafts is not None else drafts.shape[1])


def _commit(drafts: torch.Tensor, accepted: torch.Tensor, final: torch.Tensor) -> Verdict:
    b, k = drafts.shape
    j = torch.arange(k + 1, device=drafts.device).unsqueeze(0)
    padded = torch.cat([drafts, drafts.new_full((b, 1), PAD_TOKEN)], dim=1)
    tokens = torch.where(j < accepted.unsqueeze(1), padded, PAD_TOKEN)
    tokens = torch.where(j == accepted.unsqueeze(1), final.unsqueeze(1), tokens)
    return Verdict(accepted, tokens)
