"""A device round's bookkeeping kernels (verdict and advance, kernels/triton/spec_rounds.py)
against their torch references, in Triton's interpreter on CPU; the references against
the acceptance module and the paged slots the rest of the engine computes."""

from __future__ import annotations

import pytest
import torch

from ninfer_kernels import spec_rounds as ref
from ninfer_kernels.triton import spec_rounds as tri
from ninfer.engine.spec.acceptance import accept_greedy

cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU/interpreter check; gpu tests cover CUDA")
BLOCK = 4


def _round(bs: int, w: int, seed: int):
    """A batch of verify rows whose drafts match the target for a random stretch."""
    g = torch.Generator().manual_seed(seed)
    target = torch.randint(0, 50, (bs, w), generator=g)
    drafts = torch.randint(0, 50, (bs, w - 1), generator=g)
    agree = torch.randint(0, w, (bs,), generator=g)
    for b in range(bs):
        drafts[b, : agree[b]] = target[b, : agree[b]]
    ids = torch.cat([torch.randint(0, 50, (bs, 1), generator=g), drafts], dim=1).reshape(-1)
    num_drafts = torch.randint(0, w, (bs,), generator=g)
    num_drafts[0] = w - 1
    rows = torch.randint(0, 100, (bs, w), generator=g)
    return ids, num_drafts, target, rows


@pytest.mark.parametrize("w", [2, 4, 6])
def test_reference_verdict_is_the_acceptance_modules(w):
    ids, num_drafts, target, rows = _round(9, w, w)
    accepted, tokens, kept = ref.round_verdict(ids, num_drafts, target, rows)
    verdict = accept_greedy(ids.view(9, w)[:, 1:], num_drafts, target)
    assert torch.equal(accepted, verdict.accepted) and torch.equal(tokens, verdict.token_ids)
    assert torch.equal(kept, rows.gather(1, accepted.unsqueeze(1)).squeeze(1))
    assert accepted.max() > 0 and (accepted < num_drafts).any()  # the sample has both outcomes


@cpu_only
@pytest.mark.parametrize("w", [2, 4, 6])
@pytest.mark.parametrize("with_rows", [True, False])
def test_verdict_kernel_matches_reference(w, with_rows):
    ids, num_drafts, target, rows = _round(9, w, 10 + w)
    rows = rows if with_rows else None
    for got, want in zip(tri.round_verdict(ids, num_drafts, target, rows), ref.round_verdict(ids, num_drafts, target,
                                                                                              rows)):
        assert (got is None and want is None) or torch.equal(got, want)


def _static(bs: int, w: int, seed: int):
    """Static round inputs: rows at random positions with random page tables; the last row
    is padding (no pages), and one row's next positions run past its pages."""
    g = torch.Generator().manual_seed(seed)
    cols = 8
    starts = torch.randint(0, cols * BLOCK - 2 * w, (bs,), generator=g)
    pages = (starts + 2 * w + BLOCK - 1) // BLOCK
    pages[1] = (starts[1] + w) // BLOCK  # this row's next round passes its last page
    pages[-1] = 0
    positions = (starts.unsqueeze(1) + torch.arange(w)).reshape(-1)
    return {
        "input_ids": torch.randint(0, 50, (bs * w,), generator=g),
        "positions": positions,
        "slot_mapping": torch.randint(-1, 99, (bs * w,), generator=g),
        "seq_lens": starts + w,
        "num_drafts": torch.full((bs,), w - 1),
        "pages": pages,
        "block_tables": torch.randint(0, 40, (bs, cols), generator=g, dtype=torch.int32),
        "position_rows": torch.randint(1, 1 + 2 * bs * w, (bs, w), generator=g),
    }


@cpu_only
@pytest.mark.parametrize("w", [2, 4])
@pytest.mark.parametrize("banked", [True, False])
def test_advance_kernel_matches_reference(w, banked):
    bs = 5
    ids, num_drafts, target, _ = _round(bs, w, 20 + w)
    accepted, tokens, _ = ref.round_verdict(ids, num_drafts, target, None)
    drafts = torch.randint(-1, 50, (bs, w - 1), generator=torch.Generator().manual_seed(3))
    static = _static(bs, w, 30 + w)
    bank = dict(bank_first=1, bank_rows=bs * w) if banked else {}
    results = []
    for impl in (tri, ref):
        inputs = {name: t.clone() for name, t in static.items()}
        out = impl.round_advance(tokens, accepted, drafts, inputs["input_ids"], inputs["positions"],
                                 inputs["slot_mapping"], inputs["seq_lens"], inputs["num_drafts"], inputs["pages"],
                                 inputs["block_tables"], BLOCK, inputs["position_rows"], **bank)
        results.append((out, inputs))
    (out, got), (out_ref, want) = results
    assert torch.equal(out, out_ref)
    for name in static:
        assert torch.equal(got[name], want[name]), name
    # the padding row kept its inputs; a live row moved on past its kept tokens
    assert torch.equal(want["positions"].view(bs, w)[-1], static["positions"].view(bs, w)[-1])
    assert want["positions"][0] == static["positions"][0] + accepted[0] + 1
    assert (want["slot_mapping"].view(bs, w)[1] == -1).any()  # past its pages: no KV slot
    if banked:
        assert not torch.equal(want["position_rows"][0], static["position_rows"][0])


@cpu_only
@pytest.mark.parametrize("w", [2, 4, 6])
def test_draft_chain_inputs_kernel_matches_reference(w):
    """The chained drafter's inputs: kept positions' slots (-1 past the kept ones and past a
    row's pages), the chain's positions, key counts and slots, the padding row's included."""
    bs = 5
    ids, num_drafts, target, _ = _round(bs, w, 40 + w)
    accepted, tokens, _ = ref.round_verdict(ids, num_drafts, target, None)
    static = _static(bs, w, 50 + w)
    starts = static["positions"].view(bs, w)[:, 0]
    args = (tokens, accepted, starts, static["block_tables"], static["pages"], BLOCK, w - 1)
    got, want = tri.draft_chain_inputs(*args), ref.draft_chain_inputs(*args)
    assert len(got) == len(want) == 8
    for i, (g, r) in enumerate(zip(got, want)):
        assert g.shape == r.shape and torch.equal(g, r), i
    slots = want[2].view(bs, w)
    assert (slots[0, accepted[0] + 1 :] == -1).all() and (slots[-1] == -1).all()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("w", [2, 4, 6])
def test_kernels_on_cuda_match_references(w):
    """The three kernels compiled for the GPU, against the references on the CPU."""
    from ninfer_kernels import ops

    bs, cuda = 5, torch.device("cuda")
    ids, num_drafts, target, rows = _round(bs, w, 60 + w)
    want = ref.round_verdict(ids, num_drafts, target, rows)
    got = ops.round_verdict(ids.to(cuda), num_drafts.to(cuda), target.to(cuda), rows.to(cuda))
    for g, r in zip(got, want):
        assert torch.equal(g.cpu(), r)
    accepted, tokens, _ = want
    static = _static(bs, w, 70 + w)
    starts = static["positions"].view(bs, w)[:, 0]
    args = (tokens, accepted, starts, static["block_tables"], static["pages"], BLOCK, w - 1)
    on_gpu = ops.draft_chain_inputs(*(a.to(cuda) if isinstance(a, torch.Tensor) else a for a in args))
    for g, r in zip(on_gpu, ref.draft_chain_inputs(*args)):
        assert torch.equal(g.cpu(), r)
    drafts = torch.randint(-1, 50, (bs, w - 1), generator=torch.Generator().manual_seed(5))
    inputs = {name: t.clone() for name, t in static.items()}
    gpu_inputs = {name: t.to(cuda) for name, t in static.items()}
    order = ("input_ids", "positions", "slot_mapping", "seq_lens", "num_drafts", "pages", "block_tables")
    out = ref.round_advance(tokens, accepted, drafts, *(inputs[n] for n in order), BLOCK, inputs["position_rows"], 1,
                            bs * w)
    out_gpu = ops.round_advance(tokens.to(cuda), accepted.to(cuda), drafts.to(cuda), *(gpu_inputs[n] for n in order),
                                BLOCK, gpu_inputs["position_rows"], 1, bs * w)
    assert torch.equal(out_gpu.cpu(), out)
    for name in static:
        assert torch.equal(gpu_inputs[name].cpu(), inputs[name]), name
