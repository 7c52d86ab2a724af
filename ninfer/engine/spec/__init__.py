"""Speculative decoding's exact verification, backend-neutral.

A round proposes k tokens per row, scores k+1 consecutive positions of the target in one
forward, and commits the accepted drafts plus one token of the target's own. What is
committed is distributed exactly as plain sampling would be (Leviathan et al. 2023,
Chen et al. 2023), because p is the sampler's own processed distribution
(:mod:`.distribution`) and the accept tests and draws read (seed, output position)
streams of the sampler's hash (:mod:`.acceptance`).
"""

from ninfer.engine.spec.acceptance import (
    ACCEPT_STREAM,
    DRAW_STREAM,
    PAD_TOKEN,
    Verdict,
    accept_greedy,
    accept_sampled,
    verify,
)
from ninfer.engine.spec.distribution import (
    PROPOSAL_POLICIES,
    Proposal,
    TargetDistribution,
    bonus_rows,
    candidate_probs,
    draft_history_counts,
    processed_distribution,
    propose,
    verify_metadata,
    with_draft_history,
)

__all__ = [
    "ACCEPT_STREAM",
    "DRAW_STREAM",
    "PAD_TOKEN",
    "PROPOSAL_POLICIES",
    "Proposal",
    "TargetDistribution",
    "Verdict",
    "accept_greedy",
    "accept_sampled",
    "bonus_rows",
    "candidate_probs",
    "draft_history_counts",
    "processed_distribution",
    "propose",
    "verify",
    "verify_metadata",
    "with_draft_history",
]
