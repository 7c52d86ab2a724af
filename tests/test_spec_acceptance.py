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
from ninfer.engine.sampling_metadata import SamplingMetadata, TokenMask, to_device
from ninfer.engine.spec import (
    PAD_TOKEN,
    TargetDistribution,
    accept_greedy,
    bonus_rows,
    accept_sampled,
    draft_history_counts,
    processed_distribution,
    propose,
    verify,
    verify_metadata,
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


def generate(setting, n, length, k, policy="auto", draft=DRAFT, masked=False, draft_masked=True, seed0=0):
    """Speculative rounds until every row has ``length`` tokens (no row drafts past it).
    Returns tokens [n, length], round 1's first drafts [n] and the acceptance rate."""
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
        ctxs = torch.cat([prev.unsqueeze(1), drafts], 1).flatten()  # verify row j's context
        width = k + 1
        vmeta = make_meta(
            setting, seeds.repeat_interleave(width), (t.unsqueeze(1) + torch.arange(width)).flatten(),
            counts.repeat_interleave(width, 0), ALLOWED[ctxs] if masked else None,
        )  # fmt: skip
        vmeta = with_draft_history(vmeta, drafts, num_drafts)
        target = processed_distribution(TARGET[ctxs], vmeta, bonus_rows(num_drafts, m, k))
        verdict = verify(drafts, num_drafts, target, q)
        for j in range(width):
            sel = j < verdict.num_committed
            out[live[sel], t[sel] + j] = verdict.token_ids[sel, j]
        first_drafts = drafts[:, 0] if first_drafts is None else first_drafts
        accepted += int(verdict.accepted.sum())
        offered += int(num_drafts.sum())
        lengths[live] += verdict.num_committed
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


def test_greedy_prefix_with_partial_drafts() -> None:
    drafts = torch.tensor([[1, 2, 3], [1, 2, 3], [4, 5, 6], [7, 7, 7]])
    num_drafts = torch.tensor([3, 2, 3, 0])
    argmax = torch.tensor([[1, 2, 3, 9], [1, 2, 5, 5], [4, 0, 6, 1], [3, 3, 3, 3]])
    P = PAD_TOKEN
    expected = [[1, 2, 3, 9], [1, 2, 5, P], [4, 0, P, P], [3, P, P, P]]
    verdict = verify(drafts, num_drafts, TargetDistribution(argmax.flatten()))
    assert verdict.accepted.tolist() == [3, 2, 1, 0] and verdict.num_committed.tolist() == [4, 3, 2, 1]
    assert verdict.token_ids.tolist() == expected
    # greedy rows inside a random batch: one-hot p gives the same verdict, whatever q was
    one_hot = torch.nn.functional.one_hot(argmax, 10).float()
    q = torch.softmax(torch.randn(4, 3, 10, generator=torch.Generator().manual_seed(0)), -1)
    seeds, positions = torch.arange(4), torch.tensor([0, 5, 9, 2])
    for draft_probs in (None, q):
        bonus = argmax.gather(1, num_drafts.unsqueeze(1)).squeeze(1)
        mixed = accept_sampled(drafts, num_drafts, one_hot, draft_probs, bonus, seeds, positions)
        assert torch.equal(mixed.token_ids, accept_greedy(drafts, num_drafts, argmax).token_ids)


def test_seeded_rows_ignore_batch_order_and_neighbours() -> None:
    gen = torch.Generator().manual_seed(7)
    vocab, k, t = 50, 3, 4
    target_logits = torch.randn(30, k + 1, vocab, generator=gen) * 2
    draft_logits = target_logits[:, :k] + torch.randn(30, k, vocab, generator=gen)
    kinds = [dict(top_k=10), dict(top_p=0.8), dict(presence_penalty=0.5)]
    mine = [row(seed=s, **kinds[s % 3]) for s in range(30)]
    neighbours = [[], [row(temperature=0.0)], [row(top_k=40, seed=1), row(seed=2, frequency_penalty=1.0)]]
    results = []
    for others in neighbours:
        for at in sorted({0, len(others)}):
            perm = torch.randperm(len(mine), generator=gen)  # and shuffle my rows among themselves
            order = others[:at] + [mine[int(i)] for i in perm] + others[at:]
            idx = torch.cat([torch.zeros(at, dtype=torch.int64), perm, torch.zeros(len(others) - at, dtype=torch.int64)])
            n = len(order)
            history = dict(output_token_ids=[[1, 2]] * n, prompt_token_ids=[[0]] * n, vocab_size=vocab, device="cpu")
            drafts, qs = [], []
            for i in range(k):
                proposal = propose(draft_logits[idx, i], SamplingMetadata.build(order, [t + i] * n, **history))
                drafts.append(proposal.token_ids)
                qs.append(proposal.probs)
            drafts, q = torch.stack(drafts, 1), torch.stack(qs, 1)
            num_drafts = torch.full((n,), k)
            vmeta = verify_metadata(order, [t] * n, drafts=drafts, num_drafts=num_drafts, **history)
            verdict = verify(drafts, num_drafts, processed_distribution(target_logits[idx].flatten(0, 1), vmeta), q)
            tokens = torch.empty(len(mine), k + 1, dtype=torch.int64)
            tokens[perm] = verdict.token_ids[at : at + len(mine)]
            results.append(tokens)
    assert all(torch.equal(r, results[0]) for r in results)
    assert 0 < int((results[0] == PAD_TOKEN).sum()) < results[0].numel() // 2  # both outcomes occur


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


def test_draft_history_counts_and_verify_metadata() -> None:
    drafts = torch.tensor([[2, 2, 5], [1, -1, -1]])
    counts = draft_history_counts(drafts, torch.tensor([3, 1]), 6)
    assert counts.shape == (2, 4, 6)
    assert counts[0].tolist() == [[0] * 6, [0, 0, 1, 0, 0, 0], [0, 0, 2, 0, 0, 0], [0, 0, 2, 0, 0, 1]]
    assert counts[1].tolist() == [[0] * 6] + [[0, 1, 0, 0, 0, 0]] * 3  # padding never counts
    penalised = row(presence_penalty=0.5, repetition_penalty=1.2, min_tokens=2, stop_token_ids=(4,), seed=3)
    rows = [penalised, row(temperature=0.0)]
    outputs, prompts = [[0, 2], []], [[3], [5]]
    meta = verify_metadata(rows, [1, 0], outputs, prompts, drafts, torch.tensor([3, 1]), 6, "cpu")
    # the same rows built one by one, the drafts written into their histories
    flat = [
        (r, t + j, out + [x for x in drafts[b, :j].tolist() if x >= 0], prompts[b])
        for b, (r, t, out) in enumerate(zip(rows, [1, 0], outputs))
        for j in range(4)
    ]
    ref = SamplingMetadata.build(*[list(c) for c in zip(*flat)], 6, "cpu")
    assert torch.equal(meta.output_counts, ref.output_counts)
    assert torch.equal(meta.repetition_mask, ref.repetition_mask)
    assert torch.equal(meta.positions, ref.positions) and torch.equal(meta.banned_stops, ref.banned_stops)
    assert meta.banned_stops.tolist() == [4]  # row 0 at position 1 < min_tokens only


def test_processed_distribution_is_the_samplers() -> None:
    gen = torch.Generator().manual_seed(11)
    settings = [row(top_k=3), row(temperature=0.0, presence_penalty=1.0), row(top_p=0.7, min_p=0.1, temperature=0.6),
                row(logit_bias={1: 3.0}, repetition_penalty=1.5), row(stop_token_ids=(0,), min_tokens=5)]  # fmt: skip
    rows = [attrs.evolve(s, seed=i) for i, s in enumerate(settings)] * 40
    logits = torch.randn(len(rows), V, generator=gen) * 2
    meta = SamplingMetadata.build(rows, [2] * len(rows), [[1, 3]] * len(rows), [[2]] * len(rows), V, "cpu")
    dist = processed_distribution(logits, meta)
    assert torch.equal(dist.token_ids, Sampler()(logits, meta).token_ids)
    some = torch.tensor([7, 1, 150, 3])  # drawing a few rows only draws the same tokens
    assert torch.equal(processed_distribution(logits, meta, some).token_ids, dist.token_ids[some])
    assert torch.allclose(dist.probs.sum(-1), torch.ones(len(rows)))
    assert torch.equal(dist.probs[1], torch.nn.functional.one_hot(dist.token_ids[1], V).float())
    # a row's p does not depend on the ranked slice's width (the batch's largest top-k)
    alone = processed_distribution(logits[:1], SamplingMetadata.build(rows[:1], [2], [[1, 3]], [[2]], V, "cpu"))
    assert torch.equal(alone.probs[0], dist.probs[0])
    greedy = propose(logits, meta, "greedy")
    assert greedy.probs is None and greedy.token_ids[1] == dist.token_ids[1]
    auto = propose(logits, meta, "probabilistic")
    assert torch.equal(auto.token_ids, dist.token_ids) and torch.equal(auto.probs, dist.probs)
    with pytest.raises(ValueError):
        propose(logits, meta, "sometimes")


ROUND_VOCAB, ROUND_K, ROUND_ROWS = 4096, 3, 5


def _round_logits(device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's verify-row logits and the draft's logits of :func:`_round_on`."""
    gen = torch.Generator().manual_seed(5)
    b, k, vocab = ROUND_ROWS, ROUND_K, ROUND_VOCAB
    target_logits = torch.randn(b * (k + 1), vocab, generator=gen) * 3
    draft_logits = target_logits.view(b, k + 1, vocab)[:, :k] + torch.randn(b, k, vocab, generator=gen)
    return target_logits.to(device), draft_logits.to(device)


def _round_on(device: str, graph: bool = False, logits=None):
    """One k=3 round of five varied rows on ``device``: drafts, p's bonus draws, verdict."""
    vocab, k = ROUND_VOCAB, ROUND_K
    rows = [row(seed=1, top_k=20, top_p=0.95), row(seed=2, temperature=0.7, presence_penalty=1.5, top_p=0.8),
            row(seed=3, temperature=0.0, repetition_penalty=1.1), row(seed=4, min_p=0.05, logit_bias={5: 2.0}),
            row(seed=5, frequency_penalty=0.3, min_tokens=6, stop_token_ids=(7, 8))]  # fmt: skip
    b, t = len(rows), 3
    target_logits, draft_logits = logits if logits is not None else _round_logits(device)
    history = dict(output_token_ids=[[1, 2]] * b, prompt_token_ids=[[3, 4, 5]] * b)
    drafts, qs = [], []
    for i in range(k):
        meta = SamplingMetadata.build(rows, [t + i] * b, **history, vocab_size=vocab, device=device)
        proposal = propose(draft_logits[:, i], meta)
        drafts.append(proposal.token_ids)
        qs.append(proposal.probs)
    drafts, q = torch.stack(drafts, 1), torch.stack(qs, 1)
    num_drafts = to_device([3, 3, 2, 3, 1], torch.int64, torch.device(device))  # (a plain copy would sync)
    vmeta = verify_metadata(rows, [t] * b, history["output_token_ids"], history["prompt_token_ids"],
                            drafts, num_drafts, vocab, device)  # fmt: skip
    picks = bonus_rows(num_drafts, b, k)

    def step(logits):
        target = processed_distribution(logits, vmeta, picks)
        return target.probs, verify(drafts, num_drafts, target, q).token_ids

    if not graph:
        return (drafts, *step(target_logits))
    static = target_logits.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step(static)  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    cuda_graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(cuda_graph):
        outputs = step(static)
    fresh = target_logits.roll(1, dims=0)
    static.copy_(fresh)
    cuda_graph.replay()
    eager = step(fresh)
    return outputs, eager


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_round_matches_cpu_without_host_syncs_and_replays_in_a_graph() -> None:
    cpu = _round_on("cpu")
    logits = _round_logits("cuda")  # (a plain host-to-device copy of the inputs syncs; the round must not)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        gpu = _round_on("cuda", logits=logits)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(gpu[0].cpu(), cpu[0]) and torch.equal(gpu[2].cpu(), cpu[2])
    assert torch.allclose(gpu[1].cpu(), cpu[1], atol=1e-6)
    (graph_probs, graph_tokens), (eager_probs, eager_tokens) = _round_on("cuda", graph=True)
    assert torch.equal(graph_tokens, eager_tokens) and torch.equal(graph_probs, eager_probs)


def test_greedy_verdict_without_metadata_equals_the_processed_one() -> None:
    """Plain greedy verify rows take the raw argmax; rows with a bias, a penalty or a
    stop ban still due go through the sampler's processing (and still agree with it)."""
    from types import SimpleNamespace

    from ninfer.engine.spec.verify_step import sample_verify_rows

    gen = torch.Generator().manual_seed(12)
    k, vocab = 3, 64
    settings = [row(temperature=0.0), row(temperature=0.0, stop_token_ids=(7,), min_tokens=2),
                row(temperature=0.0, stop_token_ids=(7,), min_tokens=9), row(temperature=0.0, logit_bias={3: 5.0})]
    logits = torch.randn(len(settings) * (k + 1), vocab, generator=gen) * 2
    logits[:, 7] += 6.0  # the stop token would win wherever it is not banned
    drafts = [[7, 7, 1], [7, 2], [5, 7, 7], [3]]
    for group in ([0, 1], [0, 1, 2, 3]):
        chunks = [SimpleNamespace(drafts=tuple(drafts[i]), seq=SimpleNamespace(
            sampling=settings[i], num_output_tokens=4, output_token_ids=[1, 2, 3, 4], token_ids=[9, 9, 1, 2, 3, 4],
            num_prompt_tokens=2, seq_id=i)) for i in group]
        rows = torch.cat([logits[i * (k + 1) : (i + 1) * (k + 1)] for i in group])
        got = sample_verify_rows(chunks, k + 1, rows, torch.device("cpu"))
        padded = torch.tensor([list(c.drafts) + [c.drafts[-1]] * (k - len(c.drafts)) for c in chunks])
        num = torch.tensor([len(c.drafts) for c in chunks])
        meta = verify_metadata([c.seq.sampling for c in chunks], [4] * len(chunks), [[1, 2, 3, 4]] * len(chunks),
                               [[9, 9]] * len(chunks), padded, num, vocab, "cpu")
        want = verify(padded, num, processed_distribution(rows, meta, bonus_rows(num, len(chunks), k)))
        assert torch.equal(got.token_ids, want.token_ids) and torch.equal(got.accepted, want.accepted)
