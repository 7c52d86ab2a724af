"""Speculative verification: exact acceptance, greedy prefix matching, seeded determinism.

The distribution tests run a toy Markov "model" (logits depend on the previous token) for
a target and a perturbed draft, generate whole rounds for 100,000 seeds at once, and
chi-square the committed tokens against the exact distribution of plain sampling.
"""

from __future__ import annotations

from itertools import product
from typing import Optional

import attrs
import pytest
import torch

from ninfer.engine.defaults import ResolvedSampling
from ninfer.engine.sampler import Sampler
from ninfer.engine.sampling_metadata import SamplingMetadata, TokenMask
from ninfer.engine.spec import (
    PAD_TOKEN,
    bonus_rows,
    accept_sampled,
    processed_distribution,
    propose,
    verify,
    with_draft_history,
)

V = 6
START = V  # context row of the first output token
NEUTRAL = ResolvedSampling(
    temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, presence_penalty=0.0,
    frequency_penalty=0.0, repetition_penalty=1.0, seed=0,
)  # fmt: skip
_gen = torch.Generator().manual_seed(1234)
TARGET = torch.randn(V + 1, V, generator=_gen) * 1.5
DRAFT = TARGET + torch.randn(V + 1, V, generator=_gen) * 1.2
#: a "grammar": token v may follow context c when ALLOWED[c, v]
ALLOWED = torch.rand(V + 1, V, generator=_gen) > 0.35
ALLOWED[torch.arange(V + 1), TARGET.argmin(-1)] = True  # every context allows something
MARKER = 2  # the "reasoning close marker" of the guided scenarios


def row(**kw) -> ResolvedSampling:
    return attrs.evolve(NEUTRAL, **kw)


def make_meta(
    setting: ResolvedSampling,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    counts: torch.Tensor,
    allowed: Optional[torch.Tensor] = None,
) -> SamplingMetadata:
    """Metadata for many rows of one setting, straight from tensors (``build`` walks Python
    lists; this keeps 400,000-row batches fast). ``counts``: output history [R, V]."""
    n = seeds.numel()
    one = SamplingMetadata.build([setting], [0], [[]], [[]], V, "cpu")
    fields: dict = {"num_rows": n}
    columns = ("temperature", "log_min_p", "top_k", "top_p", "repetition_penalty", "presence_penalty", "frequency_penalty")
    for name in columns:
        if getattr(one, name) is not None:
            fields[name] = getattr(one, name).expand(n, 1)
    if not one.all_greedy:
        fields.update(seeds=seeds, positions=positions)
    if one.output_counts is not None:
        fields["output_counts"] = counts
    if one.repetition_mask is not None:
        fields["repetition_mask"] = counts > 0
    if setting.logit_bias:
        tok, val = zip(*setting.logit_bias.items())
        fields["bias_rows"] = torch.arange(n).repeat_interleave(len(tok))
        fields["bias_token_ids"] = torch.tensor(tok).repeat(n)
        fields["bias_values"] = torch.tensor(val).repeat(n)
    if setting.stop_token_ids:
        ban = torch.zeros(n, V, dtype=torch.bool)
        ban[:, list(setting.stop_token_ids)] = (positions < setting.min_tokens).unsqueeze(1)
        fields["banned_stops"] = ban.flatten().nonzero().squeeze(1) if bool(ban.any()) else None
    if allowed is not None:
        bits = (allowed.int() << torch.arange(V, dtype=torch.int32)).sum(-1, dtype=torch.int32)
        fields["token_mask"] = TokenMask(torch.arange(n), bits.unsqueeze(1))
    return attrs.evolve(one, **fields)


def reference_probs(ctx: int, history: list[int], setting: ResolvedSampling, masked: bool) -> torch.Tensor:
    """Plain sampling's distribution for one row, written out independently of the sampler."""
    s = setting
    logits = TARGET[ctx].double().clone()
    for tok, bias in s.logit_bias.items():
        logits[tok] += bias
    counts = torch.bincount(torch.tensor(history, dtype=torch.int64), minlength=V).double()
    seen = counts > 0
    shrunk = torch.where(logits > 0, logits / s.repetition_penalty, logits * s.repetition_penalty)
    logits = torch.where(seen, shrunk, logits)
    logits = logits - s.frequency_penalty * counts - s.presence_penalty * seen
    if masked:
        logits[~ALLOWED[ctx]] = -torch.inf
    if len(history) < s.min_tokens:
        logits[list(s.stop_token_ids)] = -torch.inf
    if s.greedy:
        return torch.nn.functional.one_hot(logits.argmax(), V).double()
    probs = torch.softmax(logits / s.temperature, -1)
    probs[probs < s.min_p * probs.max()] = 0
    order = torch.sort(probs, descending=True, stable=True).indices
    if 0 < s.top_k < V:
        probs[order[s.top_k :]] = 0
    probs = probs / probs.sum()
    if s.top_p < 1:
        before = probs[order].cumsum(0) - probs[order]
        probs[order[before >= s.top_p]] = 0
    return probs / probs.sum()


def reference_joint(setting: ResolvedSampling, length: int, masked: bool) -> torch.Tensor:
    """float64 [V] * length: the probability of each token sequence under plain sampling."""
    joint = torch.ones((), dtype=torch.float64)
    for pos in range(length):
        longer = torch.zeros(joint.shape + (V,), dtype=torch.float64)
        for prefix in product(range(V), repeat=pos):
            if joint[prefix] > 0:
                ctx = prefix[-1] if prefix else START
                longer[prefix] = joint[prefix] * reference_probs(ctx, list(prefix), setting, masked)
        joint = longer
    return joint


def stopping_drafts(rule: Optional[str], prev: torch.Tensor, drafts: torch.Tensor) -> Optional[torch.Tensor]:
    """bool [m, k]: the drafts a guided engine row cannot go past (``GuidedState.verifiable``):
    under ``"refused"`` those the grammar refuses after their context (an active guide), under
    ``"marker"`` the reasoning close marker ``MARKER``."""
    if rule == "refused":
        ctxs = torch.cat([prev.unsqueeze(1), drafts[:, :-1]], 1)
        return ~ALLOWED[ctxs, drafts]
    if rule == "marker":
        return drafts == MARKER
    return None


def first_true(flags: torch.Tensor, default: int) -> torch.Tensor:
    """int64 [m]: the index of each row's first set flag, ``default`` where none is set."""
    return torch.where(flags.any(1), flags.int().argmax(1), default)


def generate(setting, n, length, k, policy="auto", draft=DRAFT, masked=False, draft_masked=True, seed0=0,
             stops: Optional[str] = None, cut_before: bool = False):
    """Speculative rounds until every row has ``length`` tokens (no row drafts past it).
    Returns tokens [n, length], round 1's first drafts [n] and the acceptance rate.

    ``stops`` applies a guided row's rules (:func:`stopping_drafts`): its drafts end with
    the first one it cannot go past (``cut_before``: end just before it instead, which is
    biased), and under ``"marker"`` nothing past an accepted marker is committed."""
    all_seeds = torch.arange(n, dtype=torch.int64) + seed0 * 7_000_003
    out = torch.full((n, length), PAD_TOKEN)
    lengths = torch.zeros(n, dtype=torch.int64)
    first_drafts, accepted, offered = None, 0, 0
    while bool((lengths < length).any()):
        live = (lengths < length).nonzero().squeeze(1)  # rows still generating, in batch order
        m, seeds, t, mine = live.numel(), all_seeds[live], lengths[live], out[live]
        prev = torch.where(t > 0, mine.gather(1, (t - 1).clamp(min=0).unsqueeze(1)).squeeze(1), START)
        history = torch.where(torch.arange(length) < t.unsqueeze(1), mine, V)
        counts = torch.zeros(m, V + 1).scatter_add_(1, history, torch.ones(m, length))[:, :V]
        num_drafts = (length - 1 - t).clamp(0, k)
        ctx, hist, drafts, qs = prev, counts.clone(), [], []
        for i in range(k):
            meta = make_meta(setting, seeds, t + i, hist, ALLOWED[ctx] if masked and draft_masked else None)
            proposal = propose(draft[ctx], meta, policy)
            drafts.append(proposal.token_ids)
            qs.append(proposal.probs)
            hist = hist + torch.nn.functional.one_hot(proposal.token_ids, V)
            ctx = proposal.token_ids
        drafts = torch.stack(drafts, 1)
        q = None if qs[0] is None else torch.stack(qs, 1)
        stopping = stopping_drafts(stops, prev, drafts)
        if stopping is not None:
            num_drafts = torch.minimum(num_drafts, first_true(stopping, k) + int(not cut_before))
        ctxs = torch.cat([prev.unsqueeze(1), drafts], 1).flatten()  # verify row j's context
        width = k + 1
        vmeta = make_meta(
            setting, seeds.repeat_interleave(width), (t.unsqueeze(1) + torch.arange(width)).flatten(),
            counts.repeat_interleave(width, 0), ALLOWED[ctxs] if masked else None,
        )  # fmt: skip
        vmeta = with_draft_history(vmeta, drafts, num_drafts)
        target = processed_distribution(TARGET[ctxs], vmeta, bonus_rows(num_drafts, m, k))
        verdict = verify(drafts, num_drafts, target, q)
        committed = verdict.num_committed
        if stops == "marker":  # GuidedState.committable: the separator follows a marker unsampled
            after = (verdict.token_ids[:, :-1] == MARKER) & (torch.arange(k) < committed.unsqueeze(1) - 1)
            committed = torch.minimum(committed, first_true(after, k) + 1)
        for j in range(width):
            sel = j < committed
            out[live[sel], t[sel] + j] = verdict.token_ids[sel, j]
        first_drafts = drafts[:, 0] if first_drafts is None else first_drafts
        accepted += int(verdict.accepted.sum())
        offered += int(num_drafts.sum())
        lengths[live] += committed
    return out, first_drafts, accepted / max(offered, 1)


def generate_plain(setting, n, length, masked=False, seed0=0):
    seeds = torch.arange(n, dtype=torch.int64) + seed0 * 7_000_003
    out = torch.zeros(n, length, dtype=torch.int64)
    counts = torch.zeros(n, V)
    prev = torch.full((n,), START)
    for pos in range(length):
        meta = make_meta(setting, seeds, torch.full((n,), pos), counts, ALLOWED[prev] if masked else None)
        out[:, pos] = prev = Sampler()(TARGET[prev], meta).token_ids
        counts = counts + torch.nn.functional.one_hot(prev, V)
    return out


def chi2_pvalue(samples: torch.Tensor, expected: torch.Tensor) -> float:
    """Pearson's test of token tuples ``samples`` [N, L] against probabilities [V] * L,
    cells of expected count < 5 pooled; a sample off the support fails outright."""
    n, length = samples.shape
    codes = (samples * V ** torch.arange(length - 1, -1, -1)).sum(1)
    observed = torch.bincount(codes, minlength=V**length).double()
    expected = expected.flatten() * n
    assert not bool((observed[expected == 0] > 0).any()), "a sample the target cannot produce"
    small = expected < 5
    obs = torch.cat([observed[~small], observed[small].sum().view(1)])
    exp = torch.cat([expected[~small], expected[small].sum().view(1)])
    keep = exp > 0
    stat = ((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()
    df = torch.tensor(float(keep.sum() - 1), dtype=torch.float64)
    return float(torch.special.gammaincc(df / 2, stat / 2))


SCENARIOS = {
    # setting, proposal policy, k, grammar on the target, grammar on the draft
    "probabilistic-topk-topp": (row(temperature=0.8, top_k=4, top_p=0.9), "probabilistic", 2, False, True),
    "greedy-proposals-minp": (row(top_p=0.85, min_p=0.05, temperature=1.3), "greedy", 3, False, True),
    "grammar-penalties": (
        row(presence_penalty=0.7, frequency_penalty=0.3, repetition_penalty=1.3, logit_bias={2: 1.0},
            stop_token_ids=(5,), min_tokens=2, top_k=5),
        "auto", 2, True, False,  # the draft ignores the grammar: its forbidden tokens must be rejected
    ),  # fmt: skip
}


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_speculative_output_is_distributed_as_plain_sampling(name: str) -> None:
    setting, policy, k, masked, draft_masked = SCENARIOS[name]
    n, length = 100_000, 3
    out, first_drafts, rate = generate(setting, n, length, k, policy, masked=masked, draft_masked=draft_masked)
    assert 0.15 < rate < 0.95, rate  # rounds really both accept and reject
    joint = reference_joint(setting, length, masked)
    pvalues = {
        "first": chi2_pvalue(out[:, :1], joint.sum((1, 2))),
        "second": chi2_pvalue(out[:, 1:2], joint.sum((0, 2))),
        "third": chi2_pvalue(out[:, 2:], joint.sum((0, 1))),
        "first two": chi2_pvalue(out[:, :2], joint.sum(2)),
        "all three": chi2_pvalue(out, joint),
    }
    assert min(pvalues.values()) > 0.01, pvalues
    # the test has power: the draft's own first proposals are far from the target
    first = joint.sum((1, 2))
    assert bool((first[first_drafts] == 0).any()) or chi2_pvalue(first_drafts.unsqueeze(1), first) < 1e-6


#: a guided engine row's rules on drafts proposed without the guide: the grammar on, or off
GUIDED_STOPS = {
    "refused": (row(temperature=0.9, top_k=5), True),  # an active guide
    "marker": (row(temperature=1.0), False),  # reasoning, before the guide starts
}


@pytest.mark.parametrize("rule", list(GUIDED_STOPS))
def test_drafts_ending_where_a_guide_stops_them_keep_the_output_exact(rule: str) -> None:
    """The engine ends a guided row's drafts with the first it cannot go past, a refused
    one or the close marker, and verifies that one too; past an accepted marker it commits
    nothing. Drafts from a q that ignores the guide then still give plain sampling."""
    setting, masked = GUIDED_STOPS[rule]
    n, length = 100_000, 3
    joint = reference_joint(setting, length, masked)
    out, _, rate = generate(setting, n, length, 2, "probabilistic", masked=masked, draft_masked=False, stops=rule)
    assert 0.15 < rate < 0.95, rate
    pvalues = {"first": chi2_pvalue(out[:, :1], joint.sum((1, 2))), "all three": chi2_pvalue(out, joint)}
    assert min(pvalues.values()) > 0.01, pvalues
    # the test has power: ending the drafts just before that draft draws plainly exactly
    # where the draft was refused (or the marker), not from the residual max(0, p - q)
    biased, _, _ = generate(setting, n, length, 2, "probabilistic", masked=masked, draft_masked=False, stops=rule,
                            cut_before=True)
    assert chi2_pvalue(biased, joint) < 1e-6


def test_greedy_speculation_equals_plain_greedy_with_penalties_and_grammar() -> None:
    setting = row(temperature=0.0, frequency_penalty=0.8, repetition_penalty=1.4, stop_token_ids=(3,), min_tokens=4)
    plain = generate_plain(setting, 4, 12, masked=True)
    for k, policy in [(1, "auto"), (3, "probabilistic"), (5, "greedy")]:
        spec, _, rate = generate(setting, 4, 12, k, policy, masked=True)
        assert torch.equal(spec, plain), (k, spec, plain)
    assert len(set(plain[0].tolist())) > 2  # the penalties really steer the argmax


@pytest.mark.parametrize("setting", [row(), row(top_k=3, temperature=0.7), row(presence_penalty=1.0, top_p=0.8)])
def test_a_draft_equal_to_the_target_reproduces_plain_sampling(setting: ResolvedSampling) -> None:
    plain = generate_plain(setting, 500, 7, masked=True)
    spec, _, rate = generate(setting, 500, 7, 3, "auto", draft=TARGET, masked=True)
    assert rate == 1.0 and torch.equal(spec, plain)


def test_no_drafts_is_plain_sampling_and_empty_residual_falls_back_to_p() -> None:
    n = 2000
    logits = TARGET[:1].expand(n, V).contiguous()
    meta = make_meta(row(top_k=5), torch.arange(n), torch.full((n,), 3), torch.zeros(n, V))
    target = processed_distribution(logits, meta)
    verdict = verify(torch.zeros(n, 0, dtype=torch.int64), None, target)
    assert torch.equal(verdict.token_ids[:, 0], Sampler()(logits, meta).token_ids)
    # p <= q everywhere (q not normalised, as rounding can leave it): rejections draw from p
    p = torch.tensor([0.5, 0.5, 0, 0]).expand(n, 2, 4).contiguous()
    q = torch.tensor([0.6, 0.6, 0, 0]).expand(n, 1, 4).contiguous()
    zeros = torch.zeros(n, dtype=torch.int64)
    out = accept_sampled(zeros.view(n, 1), None, p, q, zeros, torch.arange(n), zeros)
    rejected = out.accepted == 0
    assert 0.1 < float(rejected.float().mean()) < 0.25  # 1 - 0.5 / 0.6
    assert set(out.token_ids[rejected, 0].tolist()) == {0, 1}
