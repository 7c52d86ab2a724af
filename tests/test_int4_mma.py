"""int4 weights on the tensor cores at up to eight rows (``kernels/triton/int4_mma.py``),
straight from the row-major int4 words.

On CPU Triton's interpreter runs the kernel's emulation on the same tiles, so the
addressing, the K splits and where each output lands are checked against the dequantized
reference; under ``-m gpu`` the PTX itself runs."""

from __future__ import annotations

import pytest
import torch

from ninfer_kernels import quant_formats as qf

pytest.importorskip("triton")

from ninfer_kernels.triton import int4_mma as im  # noqa: E402
from ninfer_kernels.triton import quant_gemm as qg  # noqa: E402

from test_quant_kernels import check_rows_with_bias, random_weight, rel_err  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _weight(n, k, gen, symmetric, dtype=torch.bfloat16, device="cpu"):
    w = random_weight("int4", n, k, gen=gen, device=device, dtype=dtype)
    if symmetric:
        w = qf.Int4Group(w.qweight, w.scales, torch.full_like(w.zeros, 8), w.group_size, symmetric=True)
    return w


@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("tiles", [1, 2])
def test_matches_reference(rows, symmetric, tiles):
    """Ragged N (a partial warp and a partial program), three K parts, a bias; one or two
    16-row tiles a warp."""
    gen = torch.Generator().manual_seed(2 + rows)
    n, k = 40 if tiles == 1 else 88, 384
    w = _weight(n, k, gen, symmetric)
    check_rows_with_bias(im.int4_mma_matmul, w, rows, gen, num_warps=2, splits=3, tiles=tiles)


def test_fp16_groups_of_256_one_part():
    gen = torch.Generator().manual_seed(5)
    n, k = 32, 512
    w = _weight(n, k, gen, symmetric=False, dtype=torch.float16)
    w = qf.Int4Group(w.qweight, w.scales[:, ::2].contiguous(), w.zeros[:, ::2].contiguous(), 256)
    x = torch.randn(2, k, generator=gen).to(torch.float16)
    got = im.int4_mma_matmul(x, w, num_warps=1, splits=1)
    assert rel_err(got, qf.quant_linear(x.float(), w)) < 5e-3


def test_takes_only_what_it_serves():
    gen = torch.Generator().manual_seed(6)
    w = _weight(32, 256, gen, symmetric=True)
    x = torch.zeros(1, 256, dtype=torch.bfloat16)
    assert im.takes(x, w)
    assert not im.takes(torch.zeros(9, 256, dtype=torch.bfloat16), w)
    assert not im.takes(x.float(), w)
    assert not im.takes(torch.zeros(1, 257, dtype=torch.bfloat16)[:, 1:], w)  # misaligned rows
    small_groups = random_weight("int4_g32", 32, 256, gen=gen)
    assert not im.takes(x, small_groups)
    three_steps = qf.Int4Group(w.qweight, w.scales[:, :1], w.zeros[:, :1], 384)  # 384 = 3 x 128
    assert not im.takes(x, three_steps)
    # a view whose rows are 36 words apart: Triton would not load four words a lane at once
    wide = torch.zeros(32, 36, dtype=torch.int32)
    assert not im.takes(x, qf.Int4Group(wide[:, :32], w.scales, w.zeros, 128))
    assert im.takes(x, qf.Int4Group(torch.zeros(32, 48, dtype=torch.int32)[:, :32], w.scales, w.zeros, 128))
    assert not im.takes(x, qf.Int4Group(w.qweight, w.scales.t().contiguous().t(), w.zeros, 128))
    with pytest.raises(ValueError, match="1 to 8 aligned rows"):
        im.int4_mma_matmul(torch.zeros(9, 256, dtype=torch.bfloat16), w)


def test_quant_matmul_takes_it_unless_off(monkeypatch):
    """One to eight rows go through this kernel, more rows through the other kernels;
    ``NINFER_INT4_MMA=0``: none do."""
    gen = torch.Generator().manual_seed(7)
    w = _weight(48, 256, gen, symmetric=True)
    calls = []
    real = im.int4_mma_matmul
    monkeypatch.setattr(im, "int4_mma_matmul", lambda *a, **k: calls.append(a[0].shape[0]) or real(*a, **k))
    for on in ("1", "0"):
        monkeypatch.setenv("NINFER_INT4_MMA", on)
        for rows in (1, 8, 9):
            x = torch.randn(rows, 256, generator=gen).to(torch.bfloat16)
            assert rel_err(qg.quant_matmul(x, w), qf.quant_linear(x.float(), w)) < 1e-2
    assert calls == [1, 8]


@gpu
@needs_cuda
@pytest.mark.parametrize("rows", [1, 2, 5, 8])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_matches_reference(rows, symmetric, dtype):
    """The PTX (mma.sync on the row-major words) against the reference: ragged N, K parts,
    unrolled or not."""
    gen = torch.Generator(device="cuda").manual_seed(rows)
    n, k = 1000, 1536
    w = _weight(n, k, gen, symmetric, dtype=dtype, device="cuda")
    x = torch.randn(rows, k, generator=gen, device="cuda").to(dtype)
    bias = torch.randn(n, generator=gen, device="cuda").to(dtype)
    want = qf.quant_linear(x.float(), w, bias.float())
    for warps, splits, unroll, tiles in ((8, None, 2, 1), (4, 3, 1, 1), (2, 1, 3, 1), (8, None, 2, 2), (4, 3, 1, 2)):
        got = im.int4_mma_matmul(x, w, bias, num_warps=warps, splits=splits, unroll=unroll, tiles=tiles)
        assert rel_err(got, want) < 1e-2, (warps, splits, unroll, tiles)


@gpu
@needs_cuda
def test_gpu_outliers_keep_precision():
    """The zero point comes off as (128 + z) sum x: with columns of x near 1e3 the result
    stays as close to the reference as the CUDA-core step's."""
    gen = torch.Generator(device="cuda").manual_seed(11)
    w = _weight(256, 2048, gen, symmetric=False, device="cuda")
    x = torch.randn(1, 2048, generator=gen, device="cuda")
    x[0, ::97] = 1000.0
    x = x.to(torch.bfloat16)
    want = qf.quant_linear(x.float(), w)
    assert rel_err(im.int4_mma_matmul(x, w), want) < 1e-2


@gpu
@needs_cuda
def test_gpu_27b_shapes():
    gen = torch.Generator(device="cuda").manual_seed(9)
    for n, k in ((16384, 5120), (5120, 6144), (34816, 5120), (5120, 17408), (14336, 5120)):
        w = _weight(n, k, gen, symmetric=True, device="cuda")
        x = torch.randn(1, k, generator=gen, device="cuda").to(torch.bfloat16)
        want = qf.quant_linear(x.float(), w)
        for tiles in (1, 2):
            assert rel_err(im.int4_mma_matmul(x, w, tiles=tiles), want) < 1e-2, (n, k, tiles)


@gpu
@needs_cuda
def test_gpu_wide_groups_and_padded_rows():
    """Groups of 256 (a step's group a shift of one) and x rows further apart than K."""
    gen = torch.Generator(device="cuda").manual_seed(12)
    n, k = 520, 1024
    w = _weight(n, k, gen, symmetric=False, dtype=torch.float16, device="cuda")
    w = qf.Int4Group(w.qweight, w.scales[:, ::2].contiguous(), w.zeros[:, ::2].contiguous(), 256)
    x = torch.randn(5, k + 64, generator=gen, device="cuda").to(torch.float16)[:, :k]
    assert im.takes(x, w)
    assert rel_err(im.int4_mma_matmul(x, w), qf.quant_linear(x.float(), w)) < 5e-3
