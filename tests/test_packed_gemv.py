"""The packed steps: int4 words in fp16 pairs (``kernels/triton/int4_fp16.py``: one row,
and the weight tiles of tl.dot) and e4m3 words converted two at a time
(``kernels/triton/fp8_gemv.py``).

On CPU Triton's interpreter runs each step's emulation (the same values and roundings as
its PTX); under ``-m gpu`` the PTX itself runs, against the reference and against the
emulation compiled for the GPU."""

from __future__ import annotations

from dataclasses import fields, replace

import pytest
import torch
import torch.nn.functional as F

from ninfer_kernels import quant_formats as qf

pytest.importorskip("triton")

from ninfer_kernels.triton import quant_gemm as qg  # noqa: E402
from ninfer_kernels.triton import quant_moe as qm  # noqa: E402

from ninfer_kernels import moe  # noqa: E402
from test_quant_kernels import MOE_SMALL, SHAPES_27B, TOL, moe_case, random_weight, rel_err  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
#: one row a program, 16 rows a tile, K in two parts
ONE_ROW = qg.QuantGemmConfig(BLOCK_M=1, BLOCK_N=16, BLOCK_K=128, SPLITS=2, num_stages=2, gemv=True)


def _matmul(x, w, config=ONE_ROW, packed=True, emulate=None, monkeypatch=None, bias=None):
    """``quant_matmul`` with the packed steps on or off; ``emulate`` forces their emulation
    (the GPU tests run both)."""
    monkeypatch.setenv("NINFER_PACKED_STEPS", "1" if packed else "0")
    if emulate is not None:
        real = qg.packed_options
        monkeypatch.setattr(qg, "packed_options", lambda *a: {**real(*a), "EMULATE": emulate})
    try:
        return qg.quant_matmul(x, w, bias, config)
    finally:
        monkeypatch.undo()


def _spy_packed(monkeypatch) -> list[bool]:
    seen: list[bool] = []
    real = qg.packed_options
    monkeypatch.setattr(qg, "packed_options", lambda *a: seen.append(real(*a)["PACKED"]) or real(*a))
    return seen


def _check_one_row(monkeypatch, w, gen, dtype):
    """One row of x with a bias through the packed step: near the reference, and no
    further from it than the value-by-value tile."""
    n, k = w.shape
    x = torch.randn(1, k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype)
    seen = _spy_packed(monkeypatch)
    got = qg.quant_matmul(x, w, bias, ONE_ROW)
    assert seen == [True]
    monkeypatch.undo()
    want = F.linear(x.float(), w.dequantize(), bias.float())
    assert rel_err(got, want) <= TOL
    assert rel_err(got, want) <= 2 * rel_err(_matmul(x, w, packed=False, monkeypatch=monkeypatch, bias=bias), want) + 1e-3


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,k,group", [(40, 384, 128), (33, 256, 128), (24, 200, 200)],
                         ids=["split-k", "ragged-n", "uneven-k"])
def test_packed_int4_step_equals_the_dequantized_linear(monkeypatch, dtype, n, k, group):
    """Zero points other than 8, a ragged last row tile, K not a multiple of the step."""
    gen = torch.Generator().manual_seed(n)
    if group == 128:
        w = random_weight("int4", n, k, gen=gen, dtype=dtype)
    else:  # one group over all of K
        words = torch.randint(-2**31, 2**31 - 1, (n, k // 8), generator=gen, dtype=torch.int64).to(torch.int32)
        scales = ((torch.rand(n, 1, generator=gen) + 0.5) / (4.6 * k**0.5)).to(dtype)
        w = qf.Int4Group(words, scales, torch.randint(0, 16, (n, 1), generator=gen).to(dtype), group)
    _check_one_row(monkeypatch, w, gen, dtype)


def test_large_activations_do_not_overflow_the_fp16_sums(monkeypatch):
    """The weights enter the fp16 products as (q - z) / 64, so columns of x in the tens of
    thousands (massive activations) still sum without reaching fp16's limit."""
    gen = torch.Generator().manual_seed(3)
    n, k = 32, 256
    w = random_weight("int4", n, k, gen=gen)
    x = torch.randn(1, k, generator=gen)
    x[0, 3], x[0, 130], x[0, 131] = 30000.0, -20000.0, 25000.0
    x = x.to(torch.bfloat16)
    got = _matmul(x, w, monkeypatch=monkeypatch)
    assert torch.isfinite(got).all()
    assert rel_err(got, F.linear(x.float(), w.dequantize())) <= TOL


def test_only_one_row_int4_programs_over_contiguous_x_take_the_packed_step(monkeypatch):
    gen = torch.Generator().manual_seed(4)
    w = random_weight("int4", 32, 256, gen=gen)
    x = torch.randn(3, 512, generator=gen).to(torch.bfloat16)
    seen = _spy_packed(monkeypatch)
    qg.quant_matmul(x[:1, :256], w, None, ONE_ROW)  # a row of a wider tensor: contiguous along K
    qg.quant_matmul(x[:1, ::2], w, None, ONE_ROW)  # strided along K: not
    qg.quant_matmul(x[:2, :256], w, None, qg.QuantGemmConfig(BLOCK_M=2, BLOCK_N=16, BLOCK_K=128, gemv=True))
    qg.quant_matmul(x[:1, 1:257], w, None, ONE_ROW)  # starts 2 bytes into a word: not
    assert seen == [True, False, False, False]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fmt,n,k", [("fp8", 160, 384), ("fp8_channel", 40, 384), ("fp8_channel", 24, 200)],
                         ids=["blocks-folded-into-x", "rows-scaled-at-the-end", "uneven-k"])
def test_packed_fp8_step_equals_the_dequantized_linear(monkeypatch, fmt, dtype, n, k):
    """128x128 blocks (a scale a step, the same for the tile's rows; two row blocks, the
    second ragged), per-row scales over all of K, and K not a multiple of the step."""
    gen = torch.Generator().manual_seed(n + k)
    w = random_weight(fmt, n, k, gen=gen, dtype=dtype)
    _check_one_row(monkeypatch, w, gen, dtype)


def test_fp8_rows_that_do_not_end_on_a_whole_word_keep_the_value_by_value_step(monkeypatch):
    """K = 202 stored with rows of 204 bytes: the row stride is whole words, K is not."""
    gen = torch.Generator().manual_seed(6)
    wide = random_weight("fp8_channel", 32, 204, gen=gen)
    w = qf.Fp8Block(wide.weight[:, :202], wide.scale, (1, 202))
    x = torch.randn(1, 202, generator=gen).to(torch.bfloat16)
    seen = _spy_packed(monkeypatch)
    got = qg.quant_matmul(x, w, None, ONE_ROW)
    assert seen == [False]
    monkeypatch.undo()
    assert rel_err(got, F.linear(x.float(), w.dequantize())) <= TOL


def test_fp8_scales_that_vary_inside_a_tile_keep_the_value_by_value_step(monkeypatch):
    gen = torch.Generator().manual_seed(5)
    w = random_weight("fp8", 64, 256, gen=gen)
    w = qf.Fp8Block(w.weight, w.scale.repeat_interleave(16, dim=0)[:64 // 8], (8, 128))  # 8-row blocks
    x = torch.randn(1, 256, generator=gen).to(torch.bfloat16)
    seen = _spy_packed(monkeypatch)
    got = qg.quant_matmul(x, w, None, ONE_ROW)  # 16-row tiles over 8-row blocks
    assert seen == [False]
    monkeypatch.undo()
    assert rel_err(got, F.linear(x.float(), w.dequantize())) <= TOL


@pytest.mark.parametrize("fmt", ["fp8", "int4"])
def test_one_token_moe_takes_the_one_row_steps(monkeypatch, fmt):
    """A single token's expert pairs (the shared expert among them) through the packed
    gate_up and down steps, against the reference on dequantized experts."""
    args, want = moe_case(fmt, 1, torch.Generator().manual_seed(7))
    seen: list[bool] = []
    real = qm._packed
    monkeypatch.setattr(qm, "_packed", lambda *a: seen.append(real(*a)["PACKED"]) or real(*a))
    got = qm.quant_fused_moe(*args, config=MOE_SMALL)
    assert seen == [True, True]  # gate_up, then down
    assert rel_err(got, want) <= TOL
    several, want5 = moe_case(fmt, 5, torch.Generator().manual_seed(8))
    seen.clear()
    assert rel_err(qm.quant_fused_moe(*several, config=MOE_SMALL), want5) <= TOL
    assert seen == [False, False]  # sorted runs of several tokens keep the tiles


def _packed_outputs(monkeypatch, x, w, configs):
    """The product under each config, each checked to have run the one-row packed step."""
    real = qg.packed_options
    packed: list[bool] = []
    monkeypatch.setattr(qg, "packed_options", lambda *a: packed.append(real(*a)["PACKED"]) or real(*a))
    outs = [qg.quant_matmul(x, w, None, config) for config in configs]
    monkeypatch.undo()
    assert packed == [True] * len(configs)
    return outs


def _ahead_and_in_step(monkeypatch, x, w, config):
    """The one-row step with its scales and x loaded a step ahead (``ahead``), and in the step."""
    return _packed_outputs(monkeypatch, x, w, [replace(config, ahead=ahead) for ahead in (True, False)])


AHEAD_CASES = [("int4", 40, 640, 1), ("int4", 40, 640, 3), ("int4", 33, 384, 2), ("fp8", 160, 640, 1),
               ("fp8", 160, 640, 3), ("fp8", 40, 200, 1)]
AHEAD_IDS = ["int4-five-steps", "int4-three-splits", "int4-ragged-n-uneven-splits", "fp8-five-steps",
             "fp8-three-splits", "fp8-uneven-k"]


def _ahead_case(fmt, n, k, splits, device):
    gen = torch.Generator().manual_seed(n * k)
    w = random_weight(fmt, n, k, gen=gen)
    if fmt == "int4":  # zero points that differ by row and group: each step must take its own
        zeros = torch.randint(0, 16, w.zeros.shape, generator=gen).to(w.zeros.dtype)
        w = qf.Int4Group(w.qweight, w.scales, zeros, w.group_size)
    x = torch.randn(1, k, generator=gen).to(torch.bfloat16)
    config = replace(ONE_ROW, SPLITS=splits)
    on_device = {f.name: getattr(w, f.name).to(device) for f in fields(w) if isinstance(getattr(w, f.name), torch.Tensor)}
    return x.to(device), replace(w, **on_device), config


@pytest.mark.parametrize("fmt,n,k,splits", AHEAD_CASES, ids=AHEAD_IDS)
def test_loads_a_step_ahead_change_nothing(monkeypatch, fmt, n, k, splits):
    """Loading a step's scale (and int4's zero point) and its x one step early is the same
    sum, bit for bit: every step still takes its own group's scale and its own columns of
    x, the last step of a split (and a ragged last step) included."""
    x, w, config = _ahead_case(fmt, n, k, splits, "cpu")
    ahead, in_step = _ahead_and_in_step(monkeypatch, x, w, config)
    assert torch.equal(ahead, in_step)
    assert rel_err(ahead, F.linear(x.float(), w.dequantize())) <= TOL


@gpu
@needs_cuda
@pytest.mark.parametrize("fmt,n,k,splits", AHEAD_CASES, ids=AHEAD_IDS)
def test_loads_a_step_ahead_change_nothing_on_cuda(monkeypatch, fmt, n, k, splits):
    x, w, config = _ahead_case(fmt, n, k, splits, "cuda")
    ahead, in_step = _ahead_and_in_step(monkeypatch, x, w, config)
    assert torch.equal(ahead, in_step)


def _staged_and_in_registers(monkeypatch, x, w, config):
    """The one-row step with its words staged through shared memory, then prefetched in
    registers (with and without the unrolled loop)."""
    return _packed_outputs(monkeypatch, x, w, [replace(config, staged=3), replace(config, staged=5),
                                               config, replace(config, unroll=3)])


STAGED_CASES = AHEAD_CASES + [(fmt, n, 128 * steps, splits) for fmt in ("int4", "fp8")
                              for n, steps, splits in ((40, 1, 1), (33, 7, 3))]
STAGED_IDS = AHEAD_IDS + [f"{fmt}-{case}" for fmt in ("int4", "fp8") for case in ("one-step", "ragged-n-splits")]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[gpu, needs_cuda])])
@pytest.mark.parametrize("fmt,n,k,splits", STAGED_CASES, ids=STAGED_IDS)
def test_staged_words_change_nothing(monkeypatch, fmt, n, k, splits, device):
    """Words staged through shared memory (a config's ``staged``) are the same sum, bit for
    bit, as words prefetched in registers: each step still takes its own words, scale and
    columns of x, a split's last step and a ragged K included. The interpreter runs the
    loop as written (no copies); on CUDA the pipelined loop runs."""
    x, w, config = _ahead_case(fmt, n, k, splits, device)
    staged, *others = _staged_and_in_registers(monkeypatch, x, w, config)
    for out in others:
        assert torch.equal(staged, out)
    assert rel_err(staged, F.linear(x.float(), w.dequantize().float())) <= TOL


UNROLL_CASES = [(fmt, n, 128 * steps, splits) for fmt in ("int4", "fp8") for n, steps, splits in
                ((40, 1, 1), (40, 2, 1), (40, 4, 1), (40, 7, 1), (33, 8, 3), (160, 11, 2))] + [("fp8", 40, 1000, 1)]


@gpu
@needs_cuda
@pytest.mark.parametrize("fmt,n,k,splits", UNROLL_CASES, ids=[f"{c[0]}-n{c[1]}-k{c[2]}-{c[3]}-splits"
                                                            for c in UNROLL_CASES])
def test_an_unrolled_k_loop_changes_nothing_on_cuda(monkeypatch, fmt, n, k, splits):
    """The one-row steps' K loop unrolled three times (a config's ``unroll``) is the same sum
    bit for bit, whatever the steps a split leaves to the loop after the unrolled one (0,
    1 or 2). Only compiled code unrolls: the interpreter runs the loop as written."""
    x, w, config = _ahead_case(fmt, n, k, splits, "cuda")
    outs = _packed_outputs(monkeypatch, x, w, [replace(config, unroll=unroll) for unroll in (3, 1)])
    assert torch.equal(*outs)
    assert rel_err(outs[0], F.linear(x.float(), w.dequantize().float())) <= TOL


@gpu
@needs_cuda
@pytest.mark.parametrize("fmt,n,k,splits", UNROLL_CASES, ids=[f"{c[0]}-n{c[1]}-k{c[2]}-{c[3]}-splits"
                                                            for c in UNROLL_CASES])
def test_eight_byte_word_loads_give_the_same_products_on_cuda(monkeypatch, fmt, n, k, splits):
    """A config's ``vec`` 2 (two words a thread-load, so more rows a thread) against 4: the
    same products, summed across a row's words in another order: not bit for bit, and an
    output rounded to bf16 the other way differs by one unit there (2**-8), with and
    without the unrolled loop."""
    x, w, config = _ahead_case(fmt, n, k, splits, "cuda")
    want = F.linear(x.float(), w.dequantize().float())
    wide, *narrow = _packed_outputs(monkeypatch, x, w, [config, replace(config, vec=2),
                                                         replace(config, vec=2, unroll=3)])
    for out in narrow:
        assert rel_err(out, wide) <= 2**-8
        assert rel_err(out, want) <= TOL


@pytest.mark.parametrize("config", [ONE_ROW, qg.QuantGemmConfig(BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, num_stages=2)],
                         ids=["one-row", "tiles"])
def test_int4_zero_points_at_their_extremes(monkeypatch, config):
    """Zero points 0, 15 and 16 (GPTQ's v1 layout stores z - 1 and loads add it back):
    (q - z) stays exact in fp16 on both packed steps."""
    gen = torch.Generator().manual_seed(8)
    w = random_weight("int4", 48, 256, gen=gen)
    zeros = torch.tensor([0.0, 15.0, 16.0]).repeat(48 * 2)[: 48 * 2].reshape(48, 2).to(torch.bfloat16)
    w = qf.Int4Group(w.qweight, w.scales, zeros, w.group_size)
    x = torch.randn(3, 256, generator=gen).to(torch.bfloat16)
    x = x[:1] if config is ONE_ROW else x
    assert rel_err(qg.quant_matmul(x, w, None, config), F.linear(x.float(), w.dequantize())) <= TOL


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [5, 17])
def test_int4_tiles_in_fp16_pairs_equal_the_dequantized_linear(monkeypatch, dtype, rows):
    """Several rows of x take tl.dot tiles whose int4 weights are made in fp16 pairs; the
    value-by-value tiles (NINFER_PACKED_STEPS=0) stay beside them."""
    gen = torch.Generator().manual_seed(rows)
    w = random_weight("int4", 48, 384, gen=gen, dtype=dtype)
    x = torch.randn(rows, 384, generator=gen).to(dtype)
    want = F.linear(x.float(), w.dequantize())
    config = qg.QuantGemmConfig(BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, SPLITS=3, GROUP_M=2, num_stages=2)
    seen: list[bool] = []
    real = qg.packed_options
    monkeypatch.setattr(qg, "packed_options", lambda *a: seen.append(real(*a)["PAIRS"]) or real(*a))
    assert rel_err(qg.quant_matmul(x, w, None, config), want) <= TOL
    monkeypatch.setenv("NINFER_PACKED_STEPS", "0")
    assert rel_err(qg.quant_matmul(x, w, None, config), want) <= TOL
    assert seen == [True, False]


#: every int4 step: one row packed and value by value, tiles in fp16 pairs and value by
#: value, and groups narrower than the step (each weight dequantized on its own)
INT4_STEPS = {"one-row": (ONE_ROW, 1, "int4", True), "gemv-tile": (ONE_ROW, 1, "int4", False),
              "pair-tiles": (qg.QuantGemmConfig(BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, num_stages=2), 5, "int4", True),
              "tiles": (qg.QuantGemmConfig(BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, num_stages=2), 5, "int4", False),
              "narrow-groups": (qg.QuantGemmConfig(BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, num_stages=2), 5,
                                "int4_g32", True)}


@pytest.mark.parametrize("step", INT4_STEPS)
def test_symmetric_int4_takes_eight_without_reading_zero_points(monkeypatch, step):
    """A weight marked symmetric gives what its zeros of 8 give, bit for bit, on every
    int4 step; and zeros that are not 8 under the mark change nothing, so the kernel read
    none of them."""
    config, rows, fmt, packed = INT4_STEPS[step]
    gen = torch.Generator().manual_seed(3)
    w = random_weight(fmt, 48, 256, gen=gen)  # zero points 4..11
    eights = replace(w, zeros=torch.full_like(w.zeros, 8.0))
    x = torch.randn(rows, 256, generator=gen).to(torch.bfloat16)
    read = _matmul(x, eights, config, packed=packed, monkeypatch=monkeypatch)
    assert rel_err(read, F.linear(x.float(), eights.dequantize())) <= TOL
    assert torch.equal(_matmul(x, replace(eights, symmetric=True), config, packed=packed, monkeypatch=monkeypatch),
                       read)
    assert torch.equal(_matmul(x, replace(w, symmetric=True), config, packed=packed, monkeypatch=monkeypatch), read)


@pytest.mark.parametrize("tokens", [1, 5])
def test_symmetric_int4_experts_beside_an_asymmetric_shared_expert(tokens):
    """One launch reads routed and shared zero points through the same argument, so the
    mark counts only when both carry it: a symmetric shared expert beside routed ones
    that are not still reads the routed zeros (and the other way round)."""
    (x, w13, w2, weights, ids, s13, s2), _ = moe_case("int4", tokens, torch.Generator().manual_seed(tokens))

    def eights(w, symmetric):
        return replace(w, zeros=torch.full_like(w.zeros, 8.0), symmetric=symmetric)

    for routed_sym, shared_sym in ((True, True), (True, False), (False, True)):
        r13, r2 = (eights(w, routed_sym) for w in (w13, w2)) if routed_sym else (w13, w2)
        h13, h2 = (eights(w, shared_sym) for w in (s13, s2)) if shared_sym else (s13, s2)
        want = moe.fused_moe(x, r13.dequantize(), r2.dequantize(), weights, ids, h13.dequantize(), h2.dequantize())
        got = qm.quant_fused_moe(x, r13, r2, weights, ids, h13, h2, config=MOE_SMALL)
        assert rel_err(got, want) <= TOL, (routed_sym, shared_sym)


def test_loaders_mark_int4_weights_whose_zero_points_are_all_eight():
    from ninfer_plugins.weights.quantize import int4_group

    w = torch.randn(16, 256)
    assert int4_group(w, 128, symmetric=True).symmetric
    assert not int4_group(w, 128, symmetric=False).symmetric
    assert qf.zeros_are_eight(torch.full((4, 2), 8.0, dtype=torch.bfloat16))
    assert not qf.zeros_are_eight(torch.tensor([[8.0, 7.0]]))


# -- on the GPU ------------------------------------------------------------------------------
@gpu
@needs_cuda
@pytest.mark.parametrize("fmt", ["int4", "fp8", "fp8_channel"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_packed_ptx_equals_its_emulation_and_the_reference_at_27b_shapes(monkeypatch, fmt, dtype):
    gen = torch.Generator(device="cuda").manual_seed(0)
    for n, k in SHAPES_27B:
        w = random_weight(fmt, n, k, gen=gen, device="cuda", dtype=dtype)
        x = torch.randn(1, k, generator=gen, device="cuda").to(dtype)
        want = x.float() @ w.dequantize().T
        config = qg.QuantGemmConfig(1, 64, 128, 4, 1, 8, 4, gemv=True)
        asm = _matmul(x, w, config, monkeypatch=monkeypatch)
        emulated = _matmul(x, w, config, emulate=True, monkeypatch=monkeypatch)
        assert rel_err(asm, want) <= TOL, (n, k)
        # the same values and roundings (the int4 emulation may round an fp16 sum twice)
        assert rel_err(asm, emulated) <= 1e-3, (n, k)
        assert rel_err(qg.quant_linear(x, w), want) <= TOL, (n, k)  # whatever the table picks
