"""The quantized-weight kernels (FP8 block, int4, NVFP4) against dequantize-then-multiply:
``quant_linear`` and the fused MoE, in Triton's interpreter without a GPU (tiny shapes),
and at the real models' shapes under ``-m gpu``."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from ninfer_kernels import moe
from ninfer_kernels import quant_formats as qf

pytest.importorskip("triton")

from ninfer_kernels.triton import fused_moe as t_fused  # noqa: E402
from ninfer_kernels.triton import quant_gemm as qg  # noqa: E402
from ninfer_kernels.triton import quant_launch  # noqa: E402
from ninfer_kernels.triton import quant_moe as qm  # noqa: E402
from ninfer_kernels.triton import quant_tiles as qt  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: see conftest
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
#: bf16 output rounding; the FP8 tensor-core path adds e4m3 activations (twice in the MoE)
TOL, TOL_ACT, TOL_ACT_MOE = 1e-2, 5e-2, 7e-2


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    want = want.double()
    return float((got.double() - want).norm() / want.norm().clamp_min(1e-30))


def random_weight(fmt: str, *shape: int, gen: torch.Generator, device="cpu", dtype=torch.bfloat16):
    """Random codes and scales in ``fmt`` for a weight of ``shape`` ([.., N, K]); the real
    weight has entries of about K**-0.5. ``fmt``: fp8 (128x128 blocks), fp8_channel,
    int4 (group 128), int4_g32, nvfp4."""
    *lead, n, k = shape
    lead = tuple(lead)

    def rand(*size):
        return torch.rand(size, generator=gen, device=device)

    if fmt.startswith("fp8"):
        block = (1, k) if fmt == "fp8_channel" else (128, 128)
        codes = (torch.randn(*lead, n, k, generator=gen, device=device) * 64).clamp(-448, 448)
        scale = (rand(*lead, -(-n // block[0]), -(-k // block[1])) + 0.5) / (64 * k**0.5)
        return qf.Fp8Block(codes.to(torch.float8_e4m3fn), scale, block)
    if fmt.startswith("int4"):
        group = 32 if fmt == "int4_g32" else 128
        words = torch.randint(-2**31, 2**31 - 1, (*lead, n, k // 8), generator=gen, device=device, dtype=torch.int64)
        scales = ((rand(*lead, n, k // group) + 0.5) / (4.6 * k**0.5)).to(dtype)
        zeros = torch.randint(4, 12, (*lead, n, k // group), generator=gen, device=device).to(dtype)
        return qf.Int4Group(words.to(torch.int32), scales, zeros, group)
    packed = torch.randint(0, 256, (*lead, n, k // 2), generator=gen, device=device, dtype=torch.int32)
    scale = (rand(*lead, n, k // 16) * 3 + 0.5).to(torch.float8_e4m3fn)
    return qf.Nvfp4(packed.to(torch.uint8), scale, (rand(*lead) + 0.5) / (8 * k**0.5))


FORMATS = ["fp8", "fp8_channel", "int4", "int4_g32", "nvfp4"]
#: a 16-row tile, 32 columns (several column tiles, a ragged last one), split K in three
SMALL = qg.QuantGemmConfig(BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, SPLITS=3, GROUP_M=2, num_warps=4, num_stages=2)


# -- quant_linear ----------------------------------------------------------------------------
@pytest.mark.parametrize("rows", [1, 3, 17])
@pytest.mark.parametrize("fmt", FORMATS)
def test_quant_linear_equals_dequantized_linear(fmt, rows):
    """Ragged N, more rows than a tile (17), split K with a bias, for every layout."""
    gen = torch.Generator().manual_seed(rows)
    n, k = 80, 384
    w = random_weight(fmt, n, k, gen=gen)
    x = torch.randn(rows, k, generator=gen).to(torch.bfloat16)
    bias = torch.randn(n, generator=gen).to(torch.bfloat16)
    want = F.linear(x.float(), w.dequantize(), bias.float())
    got = qg.quant_matmul(x, w, bias, SMALL)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
    assert rel_err(got, want) <= TOL
    assert torch.equal(qg.quant_matmul(x, w, bias, SMALL), got)  # counters reset: the same sum again


def test_int4_narrow_groups_read_no_scales_past_k():
    """Groups of 32 with K short of the 128-column step: the step's columns past K must not
    read scales or zeros (past the last group lies other memory; here NaN, which would
    reach every output through 0 * NaN)."""
    gen = torch.Generator().manual_seed(3)
    n, k = 24, 96
    w = random_weight("int4_g32", n, k, gen=gen)
    groups = k // 32
    padded = [torch.full((n, groups + 4), float("nan"), dtype=t.dtype) for t in (w.scales, w.zeros)]
    for full, t in zip(padded, (w.scales, w.zeros)):
        full[:, :groups] = t
    w = qf.Int4Group(w.qweight, padded[0][:, :groups], padded[1][:, :groups], 32)
    x = torch.randn(3, k, generator=gen).to(torch.bfloat16)
    got = qg.quant_matmul(x, w, None, SMALL)
    assert torch.isfinite(got).all()
    assert rel_err(got, F.linear(x.float(), w.dequantize())) <= TOL


@pytest.mark.parametrize("rows", [1, 17])
@pytest.mark.parametrize("fmt", ["fp8", "fp8_channel", "nvfp4"])
def test_weight_only_tiles_in_fp16_products_match_and_saturate(fmt, rows, monkeypatch):
    """bf16 x on the GPU multiplies FP8 and NVFP4 weights in fp16 (``HALF_PRODUCTS``): forced on here,
    the product matches the dequantized one, and x beyond fp16's range saturates at 65504
    instead of turning every output it touches into inf."""
    monkeypatch.setattr(qg, "half_products", lambda x: x.dtype == torch.bfloat16)
    gen = torch.Generator().manual_seed(rows)
    n, k = 80, 384
    w = random_weight(fmt, n, k, gen=gen)
    x = torch.randn(rows, k, generator=gen).to(torch.bfloat16)
    assert qg.kernel_options(x, qg.operands(w), SMALL)["HALF"]
    assert rel_err(qg.quant_matmul(x, w, None, SMALL), F.linear(x.float(), w.dequantize())) <= TOL
    x[0, 5] = 1e6
    got = qg.quant_matmul(x, w, None, SMALL)
    assert torch.isfinite(got).all()
    clamped = x.float()
    clamped[0, 5] = 65504.0
    assert rel_err(got, F.linear(clamped, w.dequantize())) <= TOL


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("fmt", ["fp8", "int4"])
def test_gemv_path_equals_dequantized_linear(fmt, rows):
    """The no-tl.dot kernel: exactly the rows it has (3 in a 4-row tile), split K, a bias."""
    gen = torch.Generator().manual_seed(rows)
    n, k = 40, 384
    w = random_weight(fmt, n, k, gen=gen)
    x = torch.randn(rows, k, generator=gen).to(torch.bfloat16)
    bias = torch.randn(n, generator=gen).to(torch.bfloat16)
    config = qg.QuantGemmConfig(BLOCK_M=4, BLOCK_N=16, BLOCK_K=128, SPLITS=2, num_stages=2, gemv=True)
    assert rel_err(qg.quant_matmul(x, w, bias, config), F.linear(x.float(), w.dequantize(), bias.float())) <= TOL


@pytest.mark.parametrize("fmt", ["fp8", "fp8_channel"])
def test_fp8_tensor_core_path_equals_quantized_activations_times_weight(fmt):
    gen = torch.Generator().manual_seed(7)
    n, k, rows = 48, 320, 5  # K not a multiple of 128: a ragged last activation group
    w = random_weight(fmt, n, k, gen=gen)
    x = torch.randn(rows, k, generator=gen).to(torch.bfloat16)
    xq, xs = qt.quantize_activations_reference(x)
    exact = (xq.float().view(rows, -1) * xs.repeat_interleave(128, dim=1)[:, :k]) @ w.dequantize().T
    got = qg.quant_matmul(x, w, None, qg.QuantGemmConfig(32, 32, 128, 1, act_quant=True))
    assert rel_err(got, exact) <= TOL
    assert rel_err(got, x.float() @ w.dequantize().T) <= TOL_ACT


@pytest.mark.parametrize("splits", [1, 2])
def test_fp8_decode_rows_quantize_inside_the_gemm_as_the_kernel_before_does(splits):
    """Decode rows on the FP8 tensor-core path quantize x inside each K step: the same
    result, bit for bit, as 80 rows (which quantize in a kernel first) give for those rows;
    a ragged last group, split K."""
    gen = torch.Generator().manual_seed(11)
    n, k = 48, 320
    w = random_weight("fp8", n, k, gen=gen)
    x = (torch.randn(80, k, generator=gen) * torch.logspace(-2, 2, k)).to(torch.bfloat16)
    config = qg.QuantGemmConfig(16, 32, 128, splits, 1, act_quant=True)
    assert qg.kernel_options(x[:3], qg.operands(w), config)["FORMAT"] == qt.FP8_ACT_INLINE
    assert qg.kernel_options(x, qg.operands(w), config)["FORMAT"] == qt.FP8_ACT
    many = qg.quant_matmul(x, w, None, config)
    assert torch.equal(qg.quant_matmul(x[:3], w, None, config), many[:3])


@pytest.mark.parametrize("rows", [1, 3, 20])
def test_fp8_swapped_operands_give_the_unswapped_product(rows):
    """The transposed product (the weight tile first) sums the same products per K step
    as the plain one, on the tensor-core path (e4m3 x) and weight-only: equal within
    float32 reassociation, with a ragged last group, a partial column tile and split K."""
    gen = torch.Generator().manual_seed(13)
    n, k = 80, 320
    w = random_weight("fp8", n, k, gen=gen)
    x = (torch.randn(rows, k, generator=gen) * torch.logspace(-2, 2, k)).to(torch.bfloat16)
    plain = qg.QuantGemmConfig(16, 64, 128, 2, 1, act_quant=True)
    swapped = qg.QuantGemmConfig(16, 64, 128, 2, 1, act_quant=True, swap=True)
    assert qg.kernel_options(x, qg.operands(w), swapped)["SWAP"]
    assert not qg.kernel_options(x, qg.operands(w), qg.QuantGemmConfig(16, 64, 128, gemv=True, swap=True))["SWAP"]
    want = qg.quant_matmul(x, w, None, plain).float()
    got = qg.quant_matmul(x, w, None, swapped).float()
    assert rel_err(got, want) <= 1e-2  # both rounded to bf16 once
    assert rel_err(got, x.float() @ w.dequantize().T) <= TOL_ACT
    # weight-only: the converted tile first, against the weight-only tile unswapped
    weight_only = qg.QuantGemmConfig(16, 64, 128, 2, 1, swap=True)
    assert qg.kernel_options(x, qg.operands(w), weight_only)["SWAP"]
    want = qg.quant_matmul(x, w, None, qg.QuantGemmConfig(16, 64, 128, 2, 1)).float()
    got = qg.quant_matmul(x, w, None, weight_only).float()
    assert rel_err(got, want) <= 1e-2
    assert rel_err(got, x.float() @ w.dequantize().T) <= TOL


def test_activation_quantization_matches_its_reference():
    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(3, 300, generator=gen) * torch.logspace(-3, 3, 300)).to(torch.bfloat16)
    x[1, :128] = 0  # an all-zero group keeps a finite scale
    q, s = qt.quantize_activations(x)
    want_q, want_s = qt.quantize_activations_reference(x)
    assert torch.equal(s, want_s)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))


def test_int4_takes_fp16_activations_and_falls_back_for_float32():
    gen = torch.Generator().manual_seed(5)
    w = random_weight("int4", 40, 256, gen=gen, dtype=torch.float16)
    x = torch.randn(2, 256, generator=gen)
    want = x @ w.dequantize().T
    assert rel_err(qg.quant_matmul(x.half(), w, None, SMALL), want) <= TOL
    assert torch.allclose(qg.quant_linear(x, w), want, atol=1e-4)  # float32: the reference
    empty = qg.quant_linear(torch.zeros(0, 256, dtype=torch.float16), w)
    assert empty.shape == (0, 40) and empty.dtype == torch.float16


def test_decode_heuristic_fills_the_sms_and_the_table_overrides_it(monkeypatch, tmp_path):
    narrow = qg.heuristic_config(qt.FP8, 2, 5120, 17408, sms=132)
    assert narrow.BLOCK_M == 16 and narrow.SPLITS * -(-5120 // narrow.BLOCK_N) >= 132
    assert qg.heuristic_config(qt.FP8, 2, 34816, 5120, sms=132).SPLITS == 1
    staged = qg.heuristic_config(qt.FP8, 1, 5120, 17408, sms=132)  # FP8's one-row step, staged
    assert staged.gemv and staged.staged and staged.BLOCK_M == 1 and staged.SPLITS * -(-5120 // staged.BLOCK_N) >= 132
    assert qg.heuristic_config(qt.FP8, 4096, 5120, 5120).act_quant
    assert not qg.heuristic_config(qt.INT4, 4096, 5120, 5120).act_quant
    one_row = qg.heuristic_config(qt.INT4, 1, 5120, 6144, sms=132)  # int4's packed step, unrolled
    assert one_row.gemv and one_row.unroll == 3 and one_row.BLOCK_M == 1 and one_row.SPLITS * 40 >= 132
    assert qg.heuristic_config(qt.INT4, 1, 34816, 5120, sms=132).SPLITS == 1
    assert not qg.heuristic_config(qt.INT4, 2, 5120, 6144).gemv  # two rows: the tiles

    entry = qg.QuantGemmConfig(16, 128, 128, 2, 1, 8, 4)
    key = qg.table_key("int4g128", 64, 256, torch.bfloat16)
    (tmp_path / "cpu.json").write_text(json.dumps({"_comment": "test", key: {"4": entry.to_json()}}))
    monkeypatch.setattr(quant_launch, "CONFIG_DIR", tmp_path)
    qg.load_table.cache_clear()
    qg.tuned_entries.cache_clear()
    try:
        op = qg.operands(random_weight("int4", 64, 256, gen=torch.Generator()))
        assert qg.choose_config(torch.zeros(3, 256, dtype=torch.bfloat16), op) == entry
        past = qg.choose_config(torch.zeros(9, 256, dtype=torch.bfloat16), op)
        assert past == qg.heuristic_config(qt.INT4, 9, 64, 256)  # past the table: the heuristic
        # NINFER_QUANT_TABLE: another card's table serves (here one that has no entries)
        monkeypatch.setattr(quant_launch, "TABLE_FROM", "other_card")
        assert qg.choose_config(torch.zeros(3, 256, dtype=torch.bfloat16), op) == qg.heuristic_config(qt.INT4, 3, 64, 256)
    finally:
        qg.load_table.cache_clear()
        qg.tuned_entries.cache_clear()


def test_a_shape_the_table_lacks_takes_the_nearest_tuned_n_within_five_percent():
    """The 27B's in_proj runs 16,384 quantized rows where the sweep tuned 16,480: the tuned
    entry serves it, the nearer of two if both are in reach; other formats, K and dtypes,
    and Ns further than 5%, do not."""
    near, nearer, far = (qg.QuantGemmConfig(1, b, 128, 3, 1, 8, 4, gemv=True) for b in (128, 256, 64))
    table = {qg.table_key("int4g128", 16480, 5120, torch.bfloat16): {1: near},
             qg.table_key("int4g128", 16400, 5120, torch.bfloat16): {1: nearer},
             qg.table_key("int4g128", 20000, 5120, torch.bfloat16): {1: far},
             qg.table_key("fp8b128x128", 16384, 5120, torch.bfloat16): {1: far},
             qg.table_key("int4g128", 16384, 6144, torch.bfloat16): {1: far},
             qg.table_key("int4g128", 16384, 5120, torch.float16): {1: far}}
    assert qg.table_entries(table, "int4g128", 16384, 5120, torch.bfloat16) == {1: nearer}
    del table[qg.table_key("int4g128", 16400, 5120, torch.bfloat16)]
    assert qg.table_entries(table, "int4g128", 16384, 5120, torch.bfloat16) == {1: near}
    assert qg.table_entries(table, "int4g128", 19500, 5120, torch.bfloat16) == {1: far}  # its own 5%
    assert qg.table_entries(table, "int4g128", 18000, 5120, torch.bfloat16) == {}
    assert qg.table_entries(table, "int4g128", 16384, 6144, torch.bfloat16) == {1: far}  # exact wins


# -- fused MoE -------------------------------------------------------------------------------
def check_rows_with_bias(matmul, w, rows: int, gen: torch.Generator, **launch) -> None:
    """``matmul(x, w, bias, **launch)`` for ``rows`` bf16 rows of x and a bias against the
    float32 reference on the dequantized weight: shape, dtype and values (the tensor-core
    kernels' ragged-N tests)."""
    n, k = w.shape
    x = torch.randn(rows, k, generator=gen).to(torch.bfloat16)
    bias = torch.randn(n, generator=gen).to(torch.bfloat16)
    got = matmul(x, w, bias, **launch)
    want = qf.quant_linear(x.float(), w, bias.float())
    assert got.shape == (rows, n) and got.dtype == torch.bfloat16
    assert rel_err(got, want) < 1e-2


def moe_case(fmt: str, tokens: int, gen: torch.Generator, e=4, h=128, i=128, top_k=2, device="cpu"):
    """Quantized experts and a quantized shared expert (id e), routed tokens and the
    reference on the dequantized weights."""
    w13 = random_weight(fmt, e, 2 * i, h, gen=gen, device=device)
    w2 = random_weight(fmt, e, h, i, gen=gen, device=device)
    s13, s2 = random_weight(fmt, 2 * i, h, gen=gen, device=device), random_weight(fmt, h, i, gen=gen, device=device)
    x = torch.randn(tokens, h, generator=gen, device=device).to(torch.bfloat16)
    weights, ids = moe.moe_route(torch.randn(tokens, e, generator=gen, device=device), top_k, True)
    weights = torch.cat([weights, torch.rand(tokens, 1, generator=gen, device=device)], dim=1)
    ids = torch.cat([ids, torch.full_like(ids[:, :1], e)], dim=1)
    want = moe.fused_moe(x, w13.dequantize(), w2.dequantize(), weights, ids, s13.dequantize(), s2.dequantize())
    return (x, w13, w2, weights, ids, s13, s2), want


MOE_SMALL = qm.QuantMoeConfig(16, t_fused.GemmConfig(32, 128, 2, 4, 2), t_fused.GemmConfig(64, 128, 2, 4, 2))


@pytest.mark.parametrize("tokens", [1, 5])
@pytest.mark.parametrize("fmt", ["fp8", "int4", "nvfp4"])
def test_quant_fused_moe_equals_the_reference_on_dequantized_experts(fmt, tokens):
    """One token (a block per pair, no sorting) and several (the sorted runs), each with
    the shared expert in the experts' format, through the op's Triton entry point."""
    args, want = moe_case(fmt, tokens, torch.Generator().manual_seed(tokens))
    assert rel_err(t_fused.fused_moe(*args), want) <= TOL
    assert rel_err(qm.quant_fused_moe(*args, config=MOE_SMALL), want) <= TOL


@pytest.mark.parametrize("tokens", [1, 5])
@pytest.mark.parametrize("fmt", ["fp8", "int4"])
def test_quant_fused_moe_rows_left_unsummed(fmt, tokens):
    """``summed=False``: the pairs' rows (a quantized shared expert among them, or a bf16
    one beside quantized routed experts) whose float32 sum is the layer's output."""
    args, want = moe_case(fmt, tokens, torch.Generator().manual_seed(30 + tokens))
    rows = qm.quant_fused_moe(*args, config=MOE_SMALL, summed=False)
    assert rows.shape == (tokens, 3, 128)
    assert torch.equal(rows.float().sum(dim=1).to(rows.dtype), qm.quant_fused_moe(*args, config=MOE_SMALL))
    x, w13, w2, weights, ids, s13, s2 = args
    plain = (s13.dequantize(torch.bfloat16), s2.dequantize(torch.bfloat16))
    rows = qm.quant_fused_moe(x, w13, w2, weights, ids, *plain, config=MOE_SMALL, summed=False)
    assert rows.shape == (tokens, 3, 128) and rel_err(rows.float().sum(dim=1), want) <= TOL
    summed = qm.quant_fused_moe(x, w13, w2, weights, ids, *plain, config=MOE_SMALL)
    assert torch.equal(rows.float().sum(dim=1).to(rows.dtype), summed)  # one rounding, as the norm's


@pytest.mark.parametrize("tokens", [1, 5])
@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
def test_moe_experts_in_fp16_products(fmt, tokens, monkeypatch):
    """FP8 (weight-only) and NVFP4 experts with fp16 products (on by default on CUDA), forced on."""
    monkeypatch.setattr(qm, "half_products", lambda x: x.dtype == torch.bfloat16)
    args, want = moe_case(fmt, tokens, torch.Generator().manual_seed(tokens))
    assert rel_err(qm.quant_fused_moe(*args, config=MOE_SMALL), want) <= TOL


def test_fp8_moe_tensor_core_path_and_a_bf16_shared_expert():
    args, want = moe_case("fp8", 5, torch.Generator().manual_seed(11))
    act = qm.QuantMoeConfig(16, MOE_SMALL.gate_up, MOE_SMALL.down, act_quant=True)
    assert rel_err(qm.quant_fused_moe(*args, config=act), want) <= TOL_ACT_MOE
    x, w13, w2, weights, ids, s13, s2 = args
    plain = (s13.dequantize(torch.bfloat16), s2.dequantize(torch.bfloat16))
    assert rel_err(qm.quant_fused_moe(x, w13, w2, weights, ids, *plain, config=MOE_SMALL), want) <= TOL


# -- on the GPU, at the models' shapes -------------------------------------------------------
#: Qwen3.6-27B's projections (N, K): qkv, Gated DeltaNet in/out, gate_up, down
SHAPES_27B = [(14336, 5120), (16480, 5120), (5120, 6144), (34816, 5120), (5120, 17408)]


@gpu
@needs_cuda
@pytest.mark.parametrize("fmt", ["fp8", "int4", "nvfp4"])
@pytest.mark.parametrize("rows", [1, 8, 64, 512])
def test_quant_linear_at_27b_shapes_on_the_gpu(fmt, rows):
    gen = torch.Generator(device="cuda").manual_seed(rows)
    for n, k in SHAPES_27B if rows in (1, 512) else SHAPES_27B[3:4]:
        w = random_weight(fmt, n, k, gen=gen, device="cuda")
        x = torch.randn(rows, k, generator=gen, device="cuda").to(torch.bfloat16)
        want = x.float() @ w.dequantize().T
        got = qg.quant_linear(x, w)
        act = fmt == "fp8" and qg.choose_config(x, qg.operands(w)).act_quant
        assert rel_err(got, want) <= (TOL_ACT if act else TOL), (n, k)
        if fmt == "fp8":  # both FP8 paths whatever the table says
            wo = qg.quant_matmul(x, w, None, qg.heuristic_config(qt.FP8, 1, n, k))
            tc = qg.quant_matmul(x, w, None, qg.QuantGemmConfig(64, 128, 128, 1, act_quant=True))
            assert rel_err(wo, want) <= TOL and rel_err(tc, want) <= TOL_ACT
            if rows <= 16:  # the weight tile first: a register operand of the warpgroup MMA
                swapped = qg.quant_matmul(x, w, None, qg.QuantGemmConfig(16, 128, 128, 2, 1, 4, 3, swap=True))
                assert rel_err(swapped, want) <= TOL
        if fmt != "nvfp4" and rows <= 8:  # the no-tl.dot kernel
            gemv = qg.QuantGemmConfig(rows, 32, 128, 4, 1, 4, 4, gemv=True)
            assert rel_err(qg.quant_matmul(x, w, None, gemv), want) <= TOL


@gpu
@needs_cuda
def test_quant_linear_through_ops_and_a_cuda_graph():
    from ninfer_kernels import ops
    gen = torch.Generator(device="cuda").manual_seed(0)
    w = random_weight("int4", 5120, 17408, gen=gen, device="cuda")
    x = torch.randn(1, 17408, generator=gen, device="cuda").to(torch.bfloat16)
    want = ops.quant_linear(x, w)
    assert rel_err(want, x.float() @ w.dequantize().T) <= TOL
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ops.quant_linear(x, w)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want)  # split K sums in part order: replays are bit-identical


@gpu
@needs_cuda
@pytest.mark.parametrize("fmt", ["fp8", "int4", "nvfp4"])
@pytest.mark.parametrize("tokens", [1, 64, 600])
def test_quant_fused_moe_at_the_35b_shape_on_the_gpu(fmt, tokens):
    args, want = moe_case(fmt, tokens, torch.Generator(device="cuda").manual_seed(tokens),
                          e=256, h=2048, i=512, top_k=8, device="cuda")
    act = fmt == "fp8" and qm.quant_moe_config(qt.FP8, 257, 9, tokens).act_quant
    assert rel_err(t_fused.fused_moe(*args), want) <= (TOL_ACT_MOE if act else TOL)
