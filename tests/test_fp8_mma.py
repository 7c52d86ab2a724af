"""FP8 weights on the tensor cores at up to eight rows (``kernels/triton/fp8_mma.py``),
straight from the row-major e4m3 bytes, x unquantized.

On CPU Triton's interpreter runs the kernel's emulation on the same tiles, so the
addressing, the K splits, the block scales and where each output lands are checked
against the dequantized reference; under ``-m gpu`` the PTX itself runs (x's scaling into
fp16 included)."""

from __future__ import annotations

import pytest
import torch

from ninfer_kernels import quant_formats as qf

pytest.importorskip("triton")

from ninfer_kernels.triton import fp8_mma as fm  # noqa: E402
from ninfer_kernels.triton import quant_gemm as qg  # noqa: E402

from test_quant_kernels import check_rows_with_bias, random_weight, rel_err  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _blocks(w: qf.Fp8Block, bn: int, bk: int) -> qf.Fp8Block:
    """The same codes under (bn, bk) scale blocks (fresh scales, one per block)."""
    n, k = w.shape
    gen = torch.Generator(device=w.weight.device).manual_seed(n + k + bn)
    scale = (torch.rand(-(-n // bn), -(-k // bk), generator=gen, device=w.weight.device) + 0.5) / (64 * k**0.5)
    return qf.Fp8Block(w.weight, scale, (bn, bk))


@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize("tiles", [1, 2])
def test_matches_reference(rows, tiles):
    """Ragged N (a partial warp and a partial program), three K parts, a bias; one or two
    16-row tiles a warp; 128x128 blocks."""
    gen = torch.Generator().manual_seed(2 + rows)
    n, k = 40 if tiles == 1 else 88, 384
    w = random_weight("fp8", n, k, gen=gen)
    check_rows_with_bias(fm.fp8_mma_matmul, w, rows, gen, num_warps=2, splits=3, tiles=tiles)


@pytest.mark.parametrize("block", [(1, 512), (16, 256), (1, 128)])
def test_scale_blocks(block):
    """A scale per row over all of K (compressed-tensors, ModelOpt), 16-row blocks over two
    steps, a scale per row and step: each step takes its own row's scale."""
    gen = torch.Generator().manual_seed(4)
    n, k = 48, 512
    w = _blocks(random_weight("fp8", n, k, gen=gen), *block)
    x = torch.randn(2, k, generator=gen).to(torch.float16)
    got = fm.fp8_mma_matmul(x, w, num_warps=1, splits=2)
    assert rel_err(got, qf.quant_linear(x.float(), w)) < 5e-3


def test_takes_only_what_it_serves():
    gen = torch.Generator().manual_seed(6)
    w = random_weight("fp8", 32, 256, gen=gen)
    x = torch.zeros(1, 256, dtype=torch.bfloat16)
    assert fm.takes(x, w)
    assert fm.takes(x, random_weight("fp8_channel", 32, 256, gen=gen))
    assert not fm.takes(torch.zeros(9, 256, dtype=torch.bfloat16), w)
    assert not fm.takes(x.float(), w)
    assert not fm.takes(torch.zeros(1, 257, dtype=torch.bfloat16)[:, 1:], w)  # misaligned rows
    assert not fm.takes(x, _blocks(w, 128, 64))  # a group smaller than a step
    three_steps = _blocks(random_weight("fp8", 32, 768, gen=gen), 128, 384)  # a group not a power of two steps
    assert not fm.takes(torch.zeros(1, 768, dtype=torch.bfloat16), three_steps)
    # rows 72 words apart (not a multiple of 16): Triton would not load four words a lane at once
    wide = torch.zeros(32, 288, dtype=torch.float8_e4m3fn)
    assert not fm.takes(x, qf.Fp8Block(wide[:, :256], w.scale, w.block))
    assert fm.takes(x, qf.Fp8Block(torch.zeros(32, 320, dtype=torch.float8_e4m3fn)[:, :256], w.scale, w.block))
    with pytest.raises(ValueError, match="1 to 8 aligned rows"):
        fm.fp8_mma_matmul(torch.zeros(9, 256, dtype=torch.bfloat16), w)


def test_quant_matmul_takes_it_when_on(monkeypatch):
    """``NINFER_FP8_MMA=1``: one to eight rows go through this kernel, more rows through the
    other kernels; otherwise (the default) none do."""
    gen = torch.Generator().manual_seed(7)
    w = random_weight("fp8", 48, 256, gen=gen)
    calls = []
    real = fm.fp8_mma_matmul
    monkeypatch.setattr(fm, "fp8_mma_matmul", lambda *a, **k: calls.append(a[0].shape[0]) or real(*a, **k))
    for on in ("1", "0", None):
        if on is None:
            monkeypatch.delenv("NINFER_FP8_MMA")
        else:
            monkeypatch.setenv("NINFER_FP8_MMA", on)
        for rows in (1, 8, 9):
            x = torch.randn(rows, 256, generator=gen).to(torch.bfloat16)
            assert rel_err(qg.quant_matmul(x, w), qf.quant_linear(x.float(), w)) < 3e-2
    assert calls == [1, 8]


def test_a_table_route_picks_it(monkeypatch):
    """A config routed ``mma`` (what a tune writes where this kernel won) sends one to
    eight rows here with its warps, tiles and K parts; what it cannot take (nine rows)
    runs the heuristic's kernel instead."""
    gen = torch.Generator().manual_seed(8)
    w = random_weight("fp8", 80, 384, gen=gen)
    calls = []
    real = fm.fp8_mma_matmul
    monkeypatch.setattr(fm, "fp8_mma_matmul", lambda *a, **k: calls.append((a[0].shape[0], k)) or real(*a, **k))
    config = qg.QuantGemmConfig(16, 64, 128, 3, 1, 2, 1, route="mma")  # 2 warps of two tiles, 3 K parts
    for rows in (1, 8, 9):
        x = torch.randn(rows, 384, generator=gen).to(torch.bfloat16)
        assert rel_err(qg.quant_matmul(x, w, None, config), qf.quant_linear(x.float(), w)) < 3e-2
    assert calls == [(rows, {"num_warps": 2, "splits": 3, "tiles": 2}) for rows in (1, 8)]


@gpu
@needs_cuda
@pytest.mark.parametrize("rows", [1, 2, 5, 8])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_matches_reference(rows, dtype):
    """The PTX (x scaled into fp16, mma.sync on the e4m3 bytes) against the reference:
    ragged N, K parts, one or two tiles a warp."""
    gen = torch.Generator(device="cuda").manual_seed(rows)
    n, k = 1000, 1536
    w = random_weight("fp8", n, k, gen=gen, device="cuda")
    x = torch.randn(rows, k, generator=gen, device="cuda").to(dtype)
    bias = torch.randn(n, generator=gen, device="cuda").to(dtype)
    want = qf.quant_linear(x.float(), w, bias.float())
    for warps, splits, tiles in ((8, None, 1), (4, 3, 1), (2, 1, 1), (8, None, 2), (4, 5, 2), (4, None, 1)):
        got = fm.fp8_mma_matmul(x, w, bias, num_warps=warps, splits=splits, tiles=tiles)
        assert rel_err(got, want) < 5e-3, (warps, splits, tiles)


@gpu
@needs_cuda
def test_gpu_x_range():
    """x rows of very different sizes (1e-30 to 3e4, beyond fp16's range), a row of zeros,
    columns near 1e4 in one row: each row and step finds its own power of two, so every
    row keeps its precision."""
    gen = torch.Generator(device="cuda").manual_seed(11)
    n, k = 256, 2048
    w = random_weight("fp8", n, k, gen=gen, device="cuda")
    x = torch.randn(6, k, generator=gen, device="cuda")
    x[1] *= 1e-30
    x[2] *= 3e4
    x[3] = 0.0
    x[4, ::97] = 1e4
    x = x.to(torch.bfloat16)
    want = qf.quant_linear(x.float(), w)
    got = fm.fp8_mma_matmul(x, w)
    assert torch.all(got[3] == 0)
    for row in (0, 1, 2, 4, 5):
        assert rel_err(got[row], want[row]) < 5e-3, row


@gpu
@needs_cuda
def test_gpu_27b_shapes_and_channel_scales():
    gen = torch.Generator(device="cuda").manual_seed(9)
    for n, k in ((16384, 5120), (5120, 6144), (34816, 5120), (5120, 17408), (14336, 5120)):
        w = random_weight("fp8", n, k, gen=gen, device="cuda")
        x = torch.randn(1, k, generator=gen, device="cuda").to(torch.bfloat16)
        want = qf.quant_linear(x.float(), w)
        for tiles in (1, 2):
            assert rel_err(fm.fp8_mma_matmul(x, w, tiles=tiles), want) < 5e-3, (n, k, tiles)
    w = random_weight("fp8_channel", 1000, 1024, gen=gen, device="cuda")
    x = torch.randn(3, 1024 + 64, generator=gen, device="cuda").to(torch.bfloat16)[:, :1024]  # rows apart > K
    assert fm.takes(x, w)
    assert rel_err(fm.fp8_mma_matmul(x, w), qf.quant_linear(x.float(), w)) < 5e-3
