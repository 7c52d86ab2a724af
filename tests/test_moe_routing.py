"""MoE routing (softmax, top-k, the shared expert's column): the reference against
softmax/top-k, the Triton kernel against the reference (in Triton's interpreter without a
GPU)."""

from __future__ import annotations

import pytest
import torch

from _moe_cases import distinct_logits
from ninfer_kernels import moe

pytest.importorskip("triton")

from ninfer_kernels.triton import moe_route as t_route  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: see conftest


@pytest.mark.parametrize("renorm", [False, True])
def test_reference_route_matches_softmax_topk(renorm):
    gen = torch.Generator().manual_seed(0)
    logits = distinct_logits(9, 8, gen)
    x = torch.randn(9, 16, generator=gen)
    gate = torch.randn(16, generator=gen)
    want_w, want_ids = torch.softmax(logits, dim=-1).topk(3, dim=-1)
    if renorm:
        want_w = want_w / want_w.sum(-1, keepdim=True)
    w, ids = moe.moe_route(logits, 3, renorm)
    assert ids.dtype == torch.int32 and w.dtype == torch.float32
    assert torch.equal(ids, want_ids.int()) and torch.allclose(w, want_w, atol=1e-7)

    w, ids = moe.moe_route(logits, 3, renorm, x, gate)
    assert ids.shape == (9, 4) and torch.equal(ids[:, :3], want_ids.int()) and (ids[:, 3] == 8).all()
    assert torch.allclose(w[:, :3], want_w, atol=1e-7)
    assert torch.allclose(w[:, 3], torch.sigmoid(x @ gate), atol=1e-6)


def test_reference_route_ties_go_to_the_lower_id():
    logits = torch.tensor([[0.0, 2.0, 1.0, 2.0, 2.0], [1.0, 1.0, 1.0, 1.0, 1.0]])
    _, ids = moe.moe_route(logits, 3, False)
    assert ids.tolist() == [[1, 3, 4], [0, 1, 2]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("t,e,top_k,renorm,shared", [(1, 8, 2, True, False), (7, 6, 3, False, True),
                                                     (5, 37, 8, True, True), (2, 256, 8, True, True)])
def test_triton_route_equals_reference(t, e, top_k, renorm, shared, dtype):
    gen = torch.Generator().manual_seed(e)
    logits = distinct_logits(t, e, gen).to(dtype)
    x = torch.randn(t, 24, generator=gen).to(dtype)
    gate = torch.randn(1, 24, generator=gen).to(dtype) if shared else None  # a Linear(H, 1) weight
    want_w, want_ids = moe.moe_route(logits, top_k, renorm, x, gate)
    got_w, got_ids = t_route.moe_route(logits, top_k, renorm, x, gate)
    assert got_w.dtype == torch.float32 and got_ids.dtype == torch.int32
    assert torch.equal(got_ids, want_ids)
    assert (got_w - want_w).abs().max() <= 1e-6


def test_triton_route_ties_go_to_the_lower_id():
    logits = torch.tensor([[0.0, 2.0, 1.0, 2.0, 2.0], [1.0, 1.0, 1.0, 1.0, 1.0], [-3.0, -0.5, -2.0, -0.5, -0.0],
                           [-0.0, 0.0, -1.0, -1.0, -1.0]])
    _, ids = t_route.moe_route(logits, 3, True)
    # negative logits order as floats do; -0.0 ties +0.0
    assert ids.tolist() == [[1, 3, 4], [0, 1, 2], [4, 1, 3], [0, 1, 2]]
    assert moe.moe_route(logits, 3, True)[1].tolist() == ids.tolist()


@pytest.mark.parametrize("e", [5, 256])
def test_bf16_logits_rank_on_32_bit_keys_as_on_64_bit_ones(e):
    """bf16 logits (the router's output dtype) take the 32-bit keys: every sign, both
    zeros, ties among equal values, the largest finite value, tiny ones and -inf pick
    the same experts, at the same weights, as the 64-bit keys of their float32 copies."""
    gen = torch.Generator().manual_seed(e)
    values = (torch.randint(-6, 7, (16, e), generator=gen) * 0.75).to(torch.bfloat16)  # many ties
    values[0, :3] = torch.tensor([-0.0, 0.0, -0.0])
    values[1, :4] = torch.tensor([3.3895e38, -1e30, float("-inf"), 1e-38])
    values[2] = float("-inf")
    values[2, -1] = -1.0
    for top_k in (1, 3, min(e, 8)):
        for renorm in (False, True):
            w16, ids16 = t_route.moe_route(values, top_k, renorm)
            w32, ids32 = t_route.moe_route(values.float(), top_k, renorm)
            assert torch.equal(ids16, ids32) and torch.equal(w16, w32)
            assert torch.equal(ids16, moe.moe_route(values, top_k, renorm)[1])


def test_route_ranks_logits_whose_probabilities_round_equal():
    """Two distinct logits near zero beside a large one: their float32 probabilities are
    equal, and both the reference and the kernel keep the larger logit."""
    logits = torch.tensor([[4.0, -3.0035e-08, -2.9802e-08, -30.0]]).to(torch.bfloat16)
    probs = torch.softmax(logits.float(), dim=-1)
    assert probs[0, 1] == probs[0, 2] and logits[0, 2] > logits[0, 1]
    assert moe.moe_route(logits, 2, False)[1].tolist() == [[0, 2]]
    assert t_route.moe_route(logits, 2, False)[1].tolist() == [[0, 2]]
