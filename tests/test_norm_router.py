"""A MoE block's residual add, input norm and router matmul as one op
(``ops.rms_norm_router``, on unless ``NINFER_NORM_ROUTER=0``), and with the routing too
(``ops.rms_norm_route``, ``NINFER_NORM_ROUTE=1``): the references against the ops they
replace, the Triton kernel against them (in the interpreter), the routing with the shared
gate's logit among the logits, and blocks and whole models with and without them."""

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


@pytest.mark.parametrize("tokens", [1, 3])
@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("column_major", [False, True])
def test_triton_route_picks_what_the_routing_kernel_picks(tokens, shared, column_major):
    # the token's last program routes from the logits the launch stored: the same ids and
    # weights as the routing kernel run on them; twice, so the reset counter is checked too
    x, residual, weight, router, gate = _inputs(tokens, 96, 18 if column_major else 10, torch.bfloat16, seed=tokens)
    if column_major:
        router = router.t().contiguous().t()
    gate = gate if shared else None
    for _ in range(2):
        out, new_residual, weights, ids = t_norm_router.rms_norm_route(x, residual, weight, EPS, router, 3, True, gate)
        want_out, want_residual, logits = t_norm_router.rms_norm_router(x, residual, weight, EPS, router, gate)
        want_weights, want_ids = t_route.moe_route(logits, 3, True, gate_in_logits=shared)
        assert torch.equal(out, want_out) and torch.equal(new_residual, want_residual)
        assert torch.equal(ids, want_ids) and torch.equal(weights, want_weights)
    assert ids.shape == (tokens, 3 + shared) and weights.dtype == torch.float32
    # and as the reference routes them (the logits equal to within their rounding)
    ref = norm.rms_norm_route(x, residual, weight, EPS, router, 3, True, gate)
    assert torch.allclose(weights, ref[2], atol=2e-2)
    with pytest.raises(ValueError, match="top_k"):
        t_norm_router.rms_norm_route(x, residual, weight, EPS, router, 0, True)


def test_route_prefetch_takes_dense_expert_weights_only():
    experts = torch.zeros(4, 64, 32, dtype=torch.bfloat16)  # 4 KB an expert
    shared = torch.zeros(64, 32, dtype=torch.bfloat16)
    on, as_bytes, shared_bytes, stride, nbytes, chunk, chunks = t_norm_router._prefetch_args((experts, shared), True)
    assert on and as_bytes.dtype == torch.uint8 and shared_bytes.data_ptr() == shared.data_ptr()
    assert (stride, nbytes) == (4096, 4096) and chunk * chunks >= nbytes and chunk % 16 == 0
    # a shared expert laid out column-major (a CUDA linear) is one dense range too
    column_major = shared.t().contiguous().t()
    assert t_norm_router._prefetch_args((experts, column_major), True)[0]
    # without PDL (the interpreter), a strided or other-sized shared expert, or quantized experts: none
    assert not t_norm_router._prefetch_args((experts, shared), False)[0]
    assert not t_norm_router._prefetch_args((experts, torch.zeros(64, 64, dtype=torch.bfloat16)[:, ::2]), True)[0]
    assert not t_norm_router._prefetch_args((experts, torch.zeros(32, 32, dtype=torch.bfloat16)), True)[0]
    assert not t_norm_router._prefetch_args((object(), None), True)[0]
    assert t_norm_router._prefetch_args((experts, None), True)[0]


def test_reference_route_is_the_one_op_then_the_routing():
    x, residual, weight, router, gate = _inputs(4, 48, 6, torch.float32)
    out, new_residual, logits = norm.rms_norm_router(x, residual, weight, EPS, router, gate)
    got = norm.rms_norm_route(x, residual, weight, EPS, router, 2, False, gate)
    want = moe.moe_route(logits, 2, False, gate_in_logits=True)
    assert torch.equal(got[0], out) and torch.equal(got[1], new_residual)
    assert torch.equal(got[2], want[0]) and torch.equal(got[3], want[1])


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
    experts = torch.randn(256, 1024, 2048, device="cuda", dtype=torch.bfloat16)
    shared = torch.randn(2048, 1024, device="cuda", dtype=torch.bfloat16).t()  # column-major, as CUDA linears
    for prefetch in (None, (experts, shared), None):  # the one launch routes as the routing kernel does,
        fused = t_norm_router.rms_norm_route(x, residual, weight, EPS, router, 8, True, gate, prefetch)
        assert torch.equal(fused[0], got[0]) and torch.equal(fused[1], got[1])  # its counter reset after
        assert torch.equal(fused[3], routed[1]) and torch.equal(fused[2], routed[0])


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


@pytest.mark.parametrize("shared", [False, True])
def test_block_routes_in_the_one_op_with_the_flag(shared, monkeypatch):
    block = _block(shared)
    norm_layer = ZeroCentredRMSNorm(64, EPS)
    norm_layer.weight.data = 0.1 * torch.randn(64)
    x, residual = torch.randn(3, 64), torch.randn(3, 64)
    want, want_residual = block.from_residual(norm_layer, x, residual)
    calls = []
    real = ops.rms_norm_route
    monkeypatch.setattr(ops, "rms_norm_route", lambda *a: calls.append(a) or real(*a))
    monkeypatch.setattr(ops, "rms_norm_router", lambda *a: pytest.fail("took the op without the routing"))
    monkeypatch.setenv("NINFER_NORM_ROUTE", "1")
    got, got_residual = block.from_residual(norm_layer, x, residual)
    assert len(calls) == 1 and calls[0][5:7] == (2, True) and calls[0][8] is None
    assert torch.equal(got.rows, want.rows) and torch.equal(got_residual, want_residual)
    monkeypatch.setenv("NINFER_ROUTE_PREFETCH", "1")  # the hint names the experts the kernel reads next
    got, _ = block.from_residual(norm_layer, x, residual)
    assert calls[1][8][0] is block.experts.gate_up_proj and (calls[1][8][1] is not None) == shared
    assert torch.equal(got.rows, want.rows)


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
    monkeypatch.setenv("NINFER_NORM_ROUTE", "1")  # the routing in the same op
    assert generate() == want
