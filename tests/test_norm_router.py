"""A MoE block's residual add, input norm and router matmul as one op
(``ops.rms_norm_router``, on unless ``NINFER_NORM_ROUTER=0``): the reference against the two ops it
replaces, the Triton kernel against the reference (in the interpreter), the routing with
the shared gate's logit among the logits, and blocks and whole models with and without it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ninfer import LLM, SamplingParams
from ninfer_kernels import moe, norm, ops
from ninfer_plugins.models.hybrid_norms import ZeroCentredRMSNorm
from ninfer_plugins.models.layers import ExpertRows, RMSNorm
from ninfer_plugins.models.moe import SparseMoE
from ninfer_plugins.models.shared_moe import SharedExpertMoE

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: see conftest
EPS = 1e-6


def _inputs(tokens: int, hidden: int, experts: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    residual = torch.randn(tokens, hidden, generator=gen).to(dtype)
    weight = 1.0 + 0.1 * torch.randn(hidden, generator=gen)  # float32, as the zero-centred norm keeps it
    router = (torch.randn(experts, hidden, generator=gen) * hidden**-0.5).to(dtype)
    gate = (torch.randn(hidden, generator=gen) * hidden**-0.5).to(dtype)
    return x, residual, weight, router, gate


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_is_the_norm_then_the_router(dtype):
    x, residual, weight, router, gate = _inputs(5, 48, 6, dtype)
    want_out, want_residual = norm.rms_norm(x, weight, EPS, residual)
    out, new_residual, logits = norm.rms_norm_router(x, residual, weight, EPS, router)
    assert torch.equal(out, want_out) and torch.equal(new_residual, want_residual)
    assert torch.equal(logits, F.linear(want_out, router))
    _, _, with_gate = norm.rms_norm_router(x, residual, weight, EPS, router, gate)
    assert with_gate.shape == (5, 7) and torch.equal(with_gate[:, :6], logits)
    # the gate's logit read from the logits routes exactly as moe_route's own dot product
    got = moe.moe_route(with_gate, 2, True, gate_in_logits=True)
    want = moe.moe_route(logits, 2, True, want_out, gate)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


triton = pytest.importorskip("triton")
from ninfer_kernels.triton import moe_route as t_route  # noqa: E402
from ninfer_kernels.triton import norm_router as t_norm_router  # noqa: E402


@pytest.mark.parametrize("tokens", [1, 3, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("column_major", [False, True])
def test_triton_kernel_matches_the_reference(tokens, dtype, shared, column_major):
    # 96 wide (masked to 128) and 10 or 18 experts (not a multiple of the 4- or 16-row blocks);
    # CUDA models keep their linears column-major (store_linears_column_major)
    x, residual, weight, router, gate = _inputs(tokens, 96, 18 if column_major else 10, dtype, seed=tokens)
    if column_major:
        router = router.t().contiguous().t()
    gate = gate if shared else None
    got = t_norm_router.rms_norm_router(x, residual, weight, EPS, router, gate)
    want = norm.rms_norm_router(x, residual, weight, EPS, router, gate)
    assert torch.equal(got[1], want[1])  # the sum rounds once, the same way
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for g, w in ((got[0], want[0]), (got[2], want[2])):
        assert g.shape == w.shape and g.dtype == w.dtype
        assert torch.allclose(g.float(), w.float(), atol=tol, rtol=tol)


def test_triton_routing_reads_the_gate_logit_from_the_logits():
    gen = torch.Generator().manual_seed(1)
    logits = torch.stack([torch.randperm(9, generator=gen).float() * 0.37 - 1 for _ in range(4)])
    got = t_route.moe_route(logits, 3, True, gate_in_logits=True)
    want = moe.moe_route(logits, 3, True, gate_in_logits=True)
    assert torch.equal(got[1], want[1]) and torch.allclose(got[0], want[0], atol=1e-6)
    assert got[1][:, -1].tolist() == [8] * 4  # the shared expert's id is the routed count


def test_triton_kernel_refuses_prefill_sized_batches():
    x, residual, weight, router, _ = _inputs(norm.NORM_ROUTER_MAX_TOKENS + 1, 32, 4, torch.float32)
    with pytest.raises(ValueError, match="decode batches"):
        t_norm_router.rms_norm_router(x, residual, weight, EPS, router)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("tokens", [1, 8])
@pytest.mark.parametrize("column_major", [False, True])
def test_cuda_kernel_at_the_35b_a3b_shape(tokens, column_major):
    x, residual, weight, router, gate = (t.cuda() for t in _inputs(tokens, 2048, 256, torch.bfloat16))
    if column_major:  # as CUDA models store their linears; with the flag the router stays row-major
        router = router.t().contiguous().t()
    got = t_norm_router.rms_norm_router(x, residual, weight, EPS, router, gate)
    want = norm.rms_norm_router(x, residual, weight, EPS, router, gate)
    assert torch.equal(got[1], want[1])
    assert torch.allclose(got[0].float(), want[0].float(), atol=1e-2, rtol=1e-2)
    assert torch.allclose(got[2].float(), want[2].float(), atol=2e-2, rtol=2e-2)
    routed = t_route.moe_route(got[2], 8, True, gate_in_logits=True)
    reference = moe.moe_route(got[2], 8, True, gate_in_logits=True)
    assert torch.equal(routed[1], reference[1]) and torch.allclose(routed[0], reference[0], atol=1e-5)


def _block(shared: bool) -> SparseMoE:
    torch.manual_seed(0)
    h, e, i = 64, 8, 32
    block = SharedExpertMoE(h, e, 2, i, True, i) if shared else SparseMoE(h, e, 2, i, True)
    for p in block.parameters():
        p.data.normal_(0, 0.1)
    return block


@pytest.mark.parametrize("shared", [False, True])
def test_block_from_residual_is_the_norm_then_the_block(shared, monkeypatch):
    block = _block(shared)
    norm_layer = ZeroCentredRMSNorm(64, EPS)
    norm_layer.weight.data = 1.0 + 0.1 * torch.randn(64)
    x, residual = torch.randn(3, 64), torch.randn(3, 64)
    calls = []
    real = ops.rms_norm_router
    monkeypatch.setattr(ops, "rms_norm_router", lambda *a: calls.append(a) or real(*a))
    monkeypatch.setenv("NINFER_NORM_ROUTER", "0")
    want, want_residual = block.from_residual(norm_layer, x, residual)  # off: the norm, then the block
    assert not calls
    monkeypatch.delenv("NINFER_NORM_ROUTER")  # on by default
    got, got_residual = block.from_residual(norm_layer, x, residual)
    assert len(calls) == 1 and (calls[0][5] is not None) == shared
    assert isinstance(got, ExpertRows) and torch.equal(got.rows, want.rows)
    assert torch.equal(got_residual, want_residual)
    # prefill-sized batches keep the two launches
    big = torch.randn(norm.NORM_ROUTER_MAX_TOKENS + 1, 64)
    block.from_residual(norm_layer, big, big)
    assert len(calls) == 1


def test_the_flag_keeps_the_router_row_major(monkeypatch):
    from ninfer_plugins.models.layers import store_linears_column_major

    def router_strides() -> tuple:
        block = SparseMoE(64, 8, 2, 32, True)
        block.gate.weight.data = torch.randn(8, 64)
        store_linears_column_major(block)
        return block.gate.weight.stride()

    monkeypatch.delenv("NINFER_NORM_ROUTER", raising=False)
    assert router_strides() == (64, 1)  # on (the default): the one op's programs read whole rows
    monkeypatch.setenv("NINFER_NORM_ROUTER", "0")
    assert router_strides() == (1, 8)  # off: laid out for cuBLAS like every linear


def test_shared_expert_of_another_width_keeps_the_separate_path(monkeypatch):
    monkeypatch.setenv("NINFER_NORM_ROUTER", "1")
    block = SharedExpertMoE(64, 8, 2, 32, True, 48)
    for p in block.parameters():
        p.data.normal_(0, 0.1)
    monkeypatch.setattr(ops, "rms_norm_router", lambda *a: pytest.fail("took the one op"))
    out, _ = block.from_residual(RMSNorm(64, EPS), torch.randn(2, 64), torch.randn(2, 64))
    assert out.shape == (2, 64)  # the routed sum plus the shared expert, as the block returns it


@pytest.fixture(scope="module", params=["qwen3_moe", "qwen3_5_moe"])
def tiny_moe(request, tmp_path_factory):
    from ninfer.tiny.make import make_tiny

    return make_tiny(tmp_path_factory.mktemp(f"tiny-{request.param}"), request.param, seed=0)


def test_models_decode_the_same_with_the_one_op(tiny_moe, monkeypatch):
    params = SamplingParams(max_tokens=8, temperature=0, presence_penalty=0.0, ignore_eos=True)

    def generate() -> list[list[int]]:
        llm = LLM(str(tiny_moe), dtype="fp32", device="cpu", max_concurrency=3, prefill_chunk=5, block_size=4)
        tok = llm.get_tokenizer()
        prompts = [{"prompt_token_ids": tok.encode(p)} for p in ("Hello", "def add(a, b):\n    return", "A")]
        return [r.outputs[0].token_ids for r in llm.generate(prompts, params)]

    monkeypatch.setenv("NINFER_NORM_ROUTER", "0")
    want = generate()
    calls = []
    real = ops.rms_norm_router
    monkeypatch.setattr(ops, "rms_norm_router", lambda *a: calls.append(a) or real(*a))
    monkeypatch.delenv("NINFER_NORM_ROUTER")  # on by default
    assert generate() == want
    # the tiny hybrid's shared expert is wider than a routed one: its blocks keep the two ops
    assert bool(calls) == (tiny_moe.name.startswith("tiny-qwen3_moe"))
