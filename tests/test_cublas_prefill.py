"""The prefill route that dequantizes a quantized weight and multiplies with cuBLAS
(``ninfer_kernels/triton/cublas_prefill.py``), in Triton's interpreter: every format's
weights exactly as the reference dequantizes them, products across column slices, and
the table entry that routes ``quant_matmul`` through it."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from ninfer_kernels.triton import cublas_prefill as cp  # noqa: E402
from ninfer_kernels.triton import quant_gemm as qg  # noqa: E402
from test_quant_kernels import random_weight, rel_err  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

FORMATS = ["fp8", "fp8_channel", "int4", "int4_g32", "nvfp4"]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_dequantize_equals_the_reference_value_for_value(fmt, dtype):
    w = random_weight(fmt, 160, 256, gen=torch.Generator().manual_seed(1))
    assert torch.equal(cp.dequantize(w, dtype), w.dequantize(dtype))


def test_symmetric_int4_reads_no_zero_points():
    w = random_weight("int4", 64, 256, gen=torch.Generator().manual_seed(2))
    w.zeros.fill_(8)
    w.symmetric = True
    assert torch.equal(cp.dequantize(w), w.dequantize(torch.bfloat16))


@pytest.mark.parametrize("fmt", ["fp8", "int4", "nvfp4"])
def test_product_over_column_slices_equals_one_slice(fmt, monkeypatch):
    gen = torch.Generator().manual_seed(3)
    w = random_weight(fmt, 320, 256, gen=gen)
    x = torch.randn(24, 256, generator=gen).to(torch.bfloat16)
    bias = torch.randn(320, generator=gen).to(torch.bfloat16)
    whole = cp.dense_matmul(x, w, bias)
    monkeypatch.setattr(cp, "SCRATCH_BYTES", 128 * 256 * 2)  # 128 columns a slice: 3 slices, the last short
    assert cp.slice_rows(320, 256, 2) == 128
    assert torch.equal(cp.dense_matmul(x, w, bias), whole)
    want = x.float() @ w.dequantize().T + bias.float()
    assert rel_err(whole, want) < 1e-2


def test_a_dense_table_entry_routes_quant_matmul_through_it():
    gen = torch.Generator().manual_seed(4)
    w = random_weight("int4", 128, 256, gen=gen)
    x = torch.randn(80, 256, generator=gen).to(torch.bfloat16)
    dense = qg.QuantGemmConfig(64, 128, 128, route="dense")
    assert torch.equal(qg.quant_matmul(x, w, None, dense), cp.dense_matmul(x, w))
    assert rel_err(qg.quant_matmul(x, w, None, dense), x.float() @ w.dequantize().T) < 1e-2


def test_the_heuristic_dequantizes_int4_and_nvfp4_from_dense_rows_only():
    rows = qg.DENSE_ROWS
    assert qg.heuristic_config(qg.INT4, rows, 5120, 5120).route == "dense"
    assert qg.heuristic_config(qg.NVFP4, rows, 5120, 5120).route == "dense"
    assert qg.heuristic_config(qg.INT4, rows - 1, 5120, 5120).route == "triton"
    assert qg.heuristic_config(qg.FP8, 8192, 5120, 5120).route == "triton"


def test_block_scaled_where_it_cannot_run_falls_back_to_the_tiles():
    gen = torch.Generator().manual_seed(5)
    w = random_weight("fp8", 128, 256, gen=gen)
    x = torch.randn(80, 256, generator=gen).to(torch.bfloat16)
    assert not cp.block_scaled_available(x, w)  # a CPU tensor
    tiles = qg.heuristic_config(qg.FP8, 80, 128, 256)
    got = qg.quant_matmul(x, w, None, qg.QuantGemmConfig(64, 128, 128, route="block_scaled"))
    assert torch.equal(got, qg.quant_matmul(x, w, None, tiles))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("fmt", ["fp8", "int4", "nvfp4"])
def test_cublas_routes_at_a_prefill_shape_on_the_gpu(fmt):
    gen = torch.Generator(device="cuda").manual_seed(6)
    w = random_weight(fmt, 4224, 5120, gen=gen, device="cuda")  # N not a multiple of 256
    x = torch.randn(1026, 5120, generator=gen, device="cuda").to(torch.bfloat16)  # rows not a multiple of 4
    want = x.float() @ w.dequantize().T
    assert torch.equal(cp.dequantize(w), w.dequantize(torch.bfloat16))
    assert rel_err(cp.dense_matmul(x, w), want) < 1e-2
    if fmt == "fp8" and cp.block_scaled_available(x, w):
        from ninfer_kernels.triton.quant_tiles import quantize_activations
        codes, scales = quantize_activations(x)
        exact = (codes.float() * scales.repeat_interleave(128, dim=1)) @ w.dequantize().T
        got = cp.block_scaled_matmul(x, w)
        assert got.shape == (1026, 4224)
        assert rel_err(got, exact) < 1e-2  # the same e4m3 x as our tensor-core tiles
        assert rel_err(got, want) < 5e-2
        one = x[:1]  # a decode row, padded to four for cuBLAS
        assert rel_err(cp.block_scaled_matmul(one, w), exact[:1]) < 1e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_block_scaled_rows_past_the_last_whole_block_on_the_gpu():
    """N = 4,176: a last block of 80 rows, as the 27B's fused in_proj (N = 16,480) has one
    of 96; those rows take their own block's scale like the others."""
    gen = torch.Generator(device="cuda").manual_seed(7)
    w = random_weight("fp8", 4176, 1024, gen=gen, device="cuda")
    x = torch.randn(256, 1024, generator=gen, device="cuda").to(torch.bfloat16)
    if not cp.block_scaled_available(x, w):
        pytest.skip("no block-scaled scaled_mm in this torch or on this card")
    from ninfer_kernels.triton.quant_tiles import quantize_activations
    codes, scales = quantize_activations(x)
    exact = (codes.float() * scales.repeat_interleave(128, dim=1)) @ w.dequantize().T
    got = cp.block_scaled_matmul(x, w)
    assert rel_err(got[:, 4096:], exact[:, 4096:]) < 1e-2
    assert rel_err(got, exact) < 1e-2
