"""The on-device sampler: filters, distribution, seeded determinism, bias, penalties, logprobs."""

from __future__ import annotations

from typing import Sequence

import attrs
import numpy as np
import pytest
import torch

from ninfer.engine.defaults import ResolvedSampling
from ninfer.engine.sampler import Sampler, SamplerOutput, _apply_penalties, gumbel_noise, row_keys, uniform_noise
from ninfer.engine.sampling_metadata import SamplingMetadata, TokenMask

torch.set_num_threads(2)
V = 8
NEUTRAL = ResolvedSampling(
    temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, presence_penalty=0.0,
    frequency_penalty=0.0, repetition_penalty=1.0, seed=0,
)  # fmt: skip


def row(**kw) -> ResolvedSampling:
    return attrs.evolve(NEUTRAL, **kw)


def build(
    rows: Sequence[ResolvedSampling],
    vocab: int,
    positions: Sequence[int] | None = None,
    outputs: Sequence[Sequence[int]] | None = None,
    prompts: Sequence[Sequence[int]] | None = None,
    device: str = "cpu",
    token_mask: TokenMask | None = None,
) -> SamplingMetadata:
    n = len(rows)
    return SamplingMetadata.build(
        list(rows),
        list(positions) if positions is not None else [0] * n,
        list(outputs) if outputs is not None else [[] for _ in range(n)],
        list(prompts) if prompts is not None else [[] for _ in range(n)],
        vocab,
        device,
        token_mask=token_mask,
    )


def sample(logits: torch.Tensor, rows: Sequence[ResolvedSampling], **kw) -> SamplerOutput:
    return Sampler()(logits, build(rows, logits.shape[1], **kw))


def many(logits_row: torch.Tensor, n: int, **kw) -> torch.Tensor:
    """Sample one distribution ``n`` times in one batch, each row with its own seed."""
    rows = [row(seed=s, **kw) for s in range(n)]
    return sample(logits_row.expand(n, -1).contiguous(), rows).token_ids


LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])


def test_greedy_is_argmax_and_mixes_with_random_rows() -> None:
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(1))
    out = sample(logits, [row(temperature=0.0, seed=s) for s in range(6)])
    assert torch.equal(out.token_ids, logits.argmax(-1))
    mixed = [row(temperature=0.0), row(temperature=5.0, top_k=3), row(temperature=0.0, top_p=0.2)]
    meta = build(mixed, 50)
    assert not meta.all_greedy and meta.greedy_mask is not None and meta.candidate_width == 3
    tokens = Sampler()(logits[:3], meta).token_ids
    assert tokens[0] == logits[0].argmax() and tokens[2] == logits[2].argmax()


def test_uniform_noise_is_uniform_and_reproducible() -> None:
    keys = row_keys(torch.tensor([7, -3, 2**62]), torch.tensor([0, 5, 1]))
    ids = torch.arange(20000).unsqueeze(0)
    u = uniform_noise(keys, ids)
    assert u.dtype == torch.float64 and bool(((u > 0) & (u < 1)).all())
    hist = torch.stack([torch.histc(r.float(), bins=20, min=0, max=1) for r in u])
    expected = u.shape[1] / 20
    chi2 = ((hist - expected) ** 2 / expected).sum(-1)
    assert bool((chi2 < 50).all()), chi2  # 19 degrees of freedom; 50 is far in the tail
    assert abs(float(u.mean()) - 0.5) < 0.01
    assert not torch.equal(u[0], u[1])
    # the same (seed, position) gives the same noise wherever it sits and however often asked
    again = uniform_noise(row_keys(torch.tensor([2**62, 99, 7]), torch.tensor([1, 1, 0])), ids)
    assert torch.equal(again[0], u[2]) and torch.equal(again[2], u[0])
    assert torch.equal(uniform_noise(keys, ids[:, :100]), u[:, :100])
    # neighbouring positions and seeds are unrelated streams
    k = row_keys(torch.tensor([7, 7, 8]), torch.tensor([0, 1, 0]))
    g = gumbel_noise(k, ids[:, :5000])
    corr = torch.corrcoef(g)
    assert bool((corr - torch.eye(3)).abs().max() < 0.06)


@pytest.mark.parametrize(
    "kw, allowed",
    [
        (dict(top_k=3), {0, 1, 2}),
        (dict(top_k=1, temperature=3.0), {0}),
        (dict(min_p=0.3), {0, 1, 2}),  # exp(-1) = 0.37 >= 0.3 > exp(-1.5)
        (dict(min_p=0.3, temperature=2.0), {0, 1, 2, 3, 4}),  # temperature first: exp(-1) >= 0.3
        (dict(top_p=0.5), {0, 1}),
        (dict(top_p=0.5, top_k=1), {0}),
        (dict(top_k=5, top_p=0.9, min_p=0.1), {0, 1, 2, 3}),
    ],
)
def test_filters_only_ever_yield_allowed_tokens(kw: dict, allowed: set[int]) -> None:
    tokens = many(LOGITS, 3000, **kw)
    assert set(tokens.tolist()) == allowed


def _chi2(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(tokens, minlength=probs.numel()).double()
    expected = probs.double() * tokens.numel()
    keep = expected > 0
    assert bool((counts[~keep] == 0).all())
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


@pytest.mark.parametrize("temperature", [1.0, 0.6, 1.7])
def test_empirical_distribution_matches_softmax(temperature: float) -> None:
    tokens = many(LOGITS, 4000, temperature=temperature)
    # 7 degrees of freedom: P(chi2 > 30) < 1e-4; the draws are fixed by the seeds
    assert _chi2(tokens, torch.softmax(LOGITS / temperature, -1)) < 30


def test_filtered_distribution_is_renormalised() -> None:
    # top-4 renormalised: 0.455, 0.276, 0.167, 0.102; mass before the fourth is 0.898 >= 0.8
    tokens = many(LOGITS, 4000, top_k=4, top_p=0.8)
    target = torch.zeros(V)
    target[:3] = torch.softmax(LOGITS[:3], -1)
    assert _chi2(tokens, target) < 30


def test_seeded_row_ignores_its_neighbours() -> None:
    gen = torch.Generator().manual_seed(3)
    vocab = 300
    target = torch.randn(vocab, generator=gen) * 2
    settings = [dict(top_k=10), dict(top_p=0.8), dict(min_p=0.05, temperature=0.8), dict(), dict(top_k=10, top_p=0.9)]
    neighbours = [
        [],
        [row(temperature=0.0)],
        [row(top_k=250, seed=1), row(seed=2)],  # wider candidate slice, then a full-vocabulary row
        [row(top_p=0.3, seed=5), row(top_k=2, seed=6, presence_penalty=1.0), row(logit_bias={0: 3.0}, seed=8)],
    ]
    for kw in settings:
        mine = [row(seed=seed, **kw) for seed in range(40)]
        results = []
        for others in neighbours:
            for at in {0, len(others)}:
                rows = others[:at] + mine + others[at:]
                logits = torch.randn(len(rows), vocab, generator=gen)
                logits[at : at + len(mine)] = target
                out = sample(logits, rows, positions=[11] * len(rows)).token_ids
                results.append(out[at : at + len(mine)])
        assert all(torch.equal(r, results[0]) for r in results), kw
        assert len(set(results[0].tolist())) > 1  # the seeds really do draw different tokens


def test_position_changes_the_draw() -> None:
    rows = [row(seed=42)] * 200
    logits = torch.zeros(200, 1000)
    tokens = Sampler()(logits, build(rows, 1000, positions=range(200))).token_ids
    assert len(set(tokens.tolist())) > 150  # uniform over 1000 tokens, positions decorrelated


def test_unsigned_seed_wraps_onto_signed_range() -> None:
    logits = torch.zeros(2, 1000)
    tokens = sample(logits, [row(seed=2**64 - 5), row(seed=-5)]).token_ids
    assert tokens[0] == tokens[1]


def test_logit_bias_forces_and_forbids() -> None:
    forced = many(LOGITS, 500, logit_bias={6: 100.0}, temperature=1.5)
    assert set(forced.tolist()) == {6}
    banned = many(LOGITS, 2000, logit_bias={0: -100.0, 1: -100.0})
    assert not {0, 1} & set(banned.tolist())
    greedy = sample(LOGITS.unsqueeze(0), [row(temperature=0.0, logit_bias={0: -100.0})]).token_ids
    assert greedy.tolist() == [1]


def test_min_tokens_bans_stop_tokens_until_reached() -> None:
    logits = LOGITS.clone()
    logits[3] = 10.0  # a stop token, far likelier than anything else
    stops = (0, 3)
    kinds = [dict(temperature=0.0), dict(seed=1), dict(seed=2, top_k=2), dict(seed=3, top_p=0.5, min_p=0.1)]
    rows = [row(min_tokens=4, stop_token_ids=stops, **kw) for kw in kinds]
    batch = logits.expand(len(rows), -1).contiguous()
    early = sample(batch, rows, positions=[3] * len(rows)).token_ids
    assert not set(early.tolist()) & set(stops) and early[0] == 1  # greedy takes the best other token
    # from output index min_tokens on, stop tokens are ordinary candidates again
    assert sample(batch, rows, positions=[4] * len(rows)).token_ids.tolist() == [3] * len(rows)


def test_banned_stop_tokens_leave_the_rest_of_the_distribution() -> None:
    n = 4000
    rows = [row(seed=s, min_tokens=1, stop_token_ids=(0, 1, 99)) for s in range(n)]  # 99: outside the vocabulary
    tokens = sample(LOGITS.expand(n, -1).contiguous(), rows).token_ids
    target = torch.zeros(V)
    target[2:] = torch.softmax(LOGITS[2:], -1)
    assert _chi2(tokens, target) < 30


def test_rows_whose_guide_cannot_end_lose_their_stop_tokens() -> None:
    logits = torch.tensor([[0.0, 5.0, 1.0], [0.0, 5.0, 1.0], [0.0, 5.0, 1.0]])
    rows = [row(temperature=0.0, stop_token_ids=(1,), logprobs=1)] * 3
    held = TokenMask(None, None, frozenset({0, 2}))
    meta = build(rows, 3, token_mask=held)
    assert meta.token_mask is None  # nothing to unpack: no row carries a guide's bitmask
    out = Sampler()(logits, meta)
    assert out.token_ids.tolist() == [2, 1, 2]
    assert out.top_ids[:, 0].tolist() == [1, 1, 1]  # logprobs still describe the model's choice


def test_stop_bans_cost_nothing_when_no_row_needs_them() -> None:
    stops = dict(stop_token_ids=(0, 1))
    assert build([row(**stops), row(min_tokens=2, **stops)], 10, positions=[0, 2]).banned_stops is None
    assert build([row(min_tokens=5)], 10).banned_stops is None  # ignore_eos and no stop ids: nothing to ban
    meta = build([row(**stops), row(min_tokens=3, **stops)], 10, positions=[0, 2])
    assert meta.banned_stops.tolist() == [10, 11]  # flat (row, token) indices of the second row


def test_penalties_match_hand_computed_reference() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0], [1.0, 1.0, -1.0, 0.0, 4.0]])
    rows = [
        row(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25),
        row(temperature=0.0),  # no penalties: must stay untouched
    ]
    meta = build(rows, 5, outputs=[[3, 3, 1], [4, 4]], prompts=[[0, 1], [2]])
    got = _apply_penalties(logits, meta)
    # row 0: repetition on seen {0, 1, 3}: 2/2, -1*2, 3/2; then output counts {3: 2, 1: 1}
    expected0 = torch.tensor([1.0, -2.0 - 0.5 - 0.25, 0.5, 1.5 - 0.5 - 0.5, -2.0])
    assert torch.allclose(got[0], expected0)
    assert torch.equal(got[1], logits[1])


def test_penalty_histories_as_arrays_and_repeated_rows_count_the_same() -> None:
    """Histories may come as int64 arrays (the engine's ``Sequence.output_array``), and a
    verify step hands the same history object for several rows, which is counted once:
    both give what fresh lists give."""
    rows = [row(repetition_penalty=1.5, presence_penalty=0.5, frequency_penalty=0.25)] * 4
    outputs, prompts = [[3, 3, 1], [4]], [[0, 1], [2, 2]]
    want = build(rows, 6, outputs=[outputs[0], outputs[0], outputs[1], list(outputs[0])],
                 prompts=[prompts[0], list(prompts[0]), prompts[1], prompts[0]])
    out_arrays = [np.asarray(o, dtype=np.int64) for o in outputs]
    prompt_arrays = [np.asarray(p, dtype=np.int64) for p in prompts]
    got = build(rows, 6, outputs=[out_arrays[0], out_arrays[0], out_arrays[1], out_arrays[0]],
                prompts=[prompt_arrays[0], prompt_arrays[0], prompt_arrays[1], prompt_arrays[0]])
    assert torch.equal(got.output_counts, want.output_counts)
    assert torch.equal(got.repetition_mask, want.repetition_mask)
    assert want.output_counts[0, 3] == 2 and want.output_counts[2, 4] == 1 and want.repetition_mask[2, 2]


def test_penalties_steer_greedy_choice() -> None:
    logits = torch.tensor([[3.0, 2.9, 0.0]])
    rows = [row(temperature=0.0, frequency_penalty=0.2)]
    assert sample(logits, rows, outputs=[[0]]).token_ids.tolist() == [1]
    assert sample(logits, rows, outputs=[[2]]).token_ids.tolist() == [0]


def test_logprobs_are_of_the_biased_raw_distribution() -> None:
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(5)) * 3
    rows = [
        row(seed=1, logprobs=5, temperature=0.3, presence_penalty=2.0, top_k=4, logit_bias={7: 4.0}),
        row(seed=2, logprobs=0),
        row(seed=3),
    ]
    out = sample(logits, rows, outputs=[[1, 2], [], []])
    biased = logits.clone()
    biased[0, 7] += 4.0
    ref = torch.log_softmax(biased, -1)
    assert out.top_ids.shape == (3, 5) and out.top_logprobs.shape == (3, 5)
    assert torch.allclose(out.logprobs, ref.gather(1, out.token_ids.unsqueeze(1)).squeeze(1))
    assert torch.equal(out.top_ids, ref.argsort(-1, descending=True)[:, :5])
    assert torch.allclose(out.top_logprobs, ref.gather(1, out.top_ids))
    assert bool((out.top_logprobs[:, :-1] >= out.top_logprobs[:, 1:]).all())


def test_logprobs_absent_unless_asked_and_zero_gives_only_the_sampled_token() -> None:
    logits = torch.randn(2, 10)
    assert sample(logits, [row(), row(temperature=0.0)]).logprobs is None
    out = sample(logits, [row(logprobs=0), row()])
    assert out.top_ids.shape == (2, 0) and out.logprobs.shape == (2,)


def test_outputs_stay_finite_under_extreme_inputs() -> None:
    logits = torch.randn(4, 64, generator=torch.Generator().manual_seed(9)) * 1e4
    logits[:, 10:20] = -torch.inf
    logits[1] = -1e30
    logits[1, 3] = 1e30
    rows = [
        row(seed=1, temperature=1e-3, top_p=0.01, logprobs=3),
        row(seed=2, repetition_penalty=1.5, frequency_penalty=2.0, logprobs=3),
        row(seed=3, min_p=1.0, top_k=64, logit_bias={11: 100.0}),
        row(seed=4, temperature=50.0, top_k=2),
    ]
    out = sample(logits, rows, outputs=[[0], [3, 3], [1], []], prompts=[[5]] * 4)
    assert bool(((out.token_ids >= 0) & (out.token_ids < 64)).all())
    assert bool(out.logprobs.isfinite().all()) and bool(out.top_logprobs.isfinite().all())
    assert out.token_ids[1] == 3 and out.token_ids[0] == logits[0].argmax()


def test_metadata_skips_what_the_batch_does_not_need() -> None:
    plain = build([row(seed=1), row(seed=2, temperature=0.5)], 100)
    unused = (plain.top_k, plain.top_p, plain.log_min_p, plain.repetition_mask, plain.output_counts, plain.bias_rows)
    assert all(t is None for t in unused)
    assert plain.greedy_mask is None and plain.max_num_logprobs is None and plain.temperature is not None
    greedy = build([row(temperature=0.0, top_k=5, top_p=0.5)], 100)
    assert greedy.all_greedy and greedy.seeds is None and greedy.top_k is None
    # a greedy row's settings never widen or force the ranking work of random rows
    capped = build([row(top_k=7), row(top_k=3), row(temperature=0.0)], 100)
    assert capped.candidate_width == 7 and capped.top_k[:, 0].tolist() == [7, 3, 1]
    uncapped = build([row(top_k=7), row(top_k=0)], 100)
    assert uncapped.candidate_width == 100 and uncapped.top_k[:, 0].tolist() == [7, 100]
    at_vocab = build([row(top_k=100), row(top_k=500)], 100)
    assert at_vocab.top_k is None


def test_top_k_up_to_vocab_size() -> None:
    # nearly flat and strictly decreasing: ids >= 4000 hold about a fifth of the mass
    flat = -torch.arange(5000, dtype=torch.float32) * 1e-4
    tokens = many(flat, 300, top_k=4000)
    assert int(tokens.max()) < 4000 and len(set(tokens.tolist())) > 250
    # the ranked slice (width 4999) and the full sort forced by an uncapped neighbour agree
    logits = torch.randn(5000, generator=torch.Generator().manual_seed(2)).expand(31, -1).contiguous()
    mine = [row(seed=seed, top_k=4999, top_p=0.9) for seed in range(30)]
    alone = sample(logits[:30], mine).token_ids
    assert torch.equal(alone, sample(logits, mine + [row(seed=99)]).token_ids[:30])
    assert len(set(alone.tolist())) > 20


def test_mismatched_logits_are_rejected() -> None:
    with pytest.raises(ValueError):
        Sampler()(torch.zeros(2, 9), build([row(), row()], 10))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu_without_host_syncs() -> None:
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(7, 4096, generator=gen) * 3
    rows = [
        row(seed=1, top_k=20, top_p=0.95),
        row(seed=2, temperature=0.7, top_p=0.8, presence_penalty=1.5, logprobs=5),
        row(seed=3, temperature=0.0, repetition_penalty=1.1),
        row(seed=4, min_p=0.05, logit_bias={5: 2.0}),
        row(seed=5),
        row(seed=6, top_k=0, top_p=0.5, frequency_penalty=0.3),
        row(seed=7, min_tokens=9, stop_token_ids=tuple(logits[6].topk(3).indices.tolist())),
    ]
    kw = dict(positions=range(7), outputs=[[1, 2]] * 7, prompts=[[3, 4, 5]] * 7)
    cpu = sample(logits, rows, **kw)
    on_device = logits.cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        meta = build(rows, 4096, device="cuda", **kw)
        gpu = Sampler()(on_device, meta)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(gpu.token_ids.cpu(), cpu.token_ids)
    assert torch.allclose(gpu.logprobs.cpu(), cpu.logprobs, atol=1e-5)
    assert cpu.token_ids[6] not in rows[6].stop_token_ids
