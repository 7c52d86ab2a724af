"""Speculative verification, one round at a time: greedy prefix matching, seeded rows
independent of their batch, the verify rows' sampling metadata, the processed
distribution p, a whole round on CUDA without host syncs and in a graph, and the greedy
verdict that needs no metadata. (The distribution tests are in test_spec_acceptance.py.)"""

from __future__ import annotations

import attrs
import pytest
import torch

from ninfer.engine.sampler import Sampler
from ninfer.engine.sampling_metadata import SamplingMetadata, to_device
from ninfer.engine.spec import (
    PAD_TOKEN,
    TargetDistribution,
    accept_greedy,
    accept_sampled,
    bonus_rows,
    draft_history_counts,
    processed_distribution,
    propose,
    verify,
    verify_metadata,
)
from test_spec_acceptance import V, row


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
