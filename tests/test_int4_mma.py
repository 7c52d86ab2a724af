"""int4 weights on the tensor cores at up to eight rows (``kernels/triton/int4_mma.py``).

On CPU Triton's interpreter runs the kernel's emulation over the MMA layout (the same
words, pairs and slots), so the packing, the addressing, the K splits and the stores are
checked against the dequantized reference; under ``-m gpu`` the PTX itself runs."""

from __future__ import annotations

import pytest
import torch

from ninfer_kernels import quant_formats as qf

pytest.importorskip("triton")

from ninfer_kernels.triton import int4_mma as im  # noqa: E402

from test_quant_kernels import random_weight, rel_err  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _weight(n, k, gen, symmetric, dtype=torch.bfloat16, group=128, device="cpu"):
    w = random_weight("int4" if group == 128 else "int4_g32", n, k, gen=gen, device=device, dtype=dtype)
    if group not in (32, 128):
        w = qf.Int4Group(w.qweight, w.scales.repeat_interleave(128 // group, -1)[..., : k // group],
                         w.zeros.repeat_interleave(128 // group, -1)[..., : k // group], group)
    if symmetric:
        w = qf.Int4Group(w.qweight, w.scales, torch.full_like(w.zeros, 8), w.group_size, symmetric=True)
    return w


def test_layout_holds_every_nibble_once():
    """The MMA layout is a permutation of the weight's nibbles: unpacked and put back by
    the docstring's formulas, it gives the original rows and columns."""
    gen = torch.Generator().manual_seed(0)
    w = _weight(40, 256, gen, symmetric=False)
    m = im.mma_layout(w, torch.bfloat16)
    assert m.words.shape == (24, 64) and m.scales.shape == (24, 2)
    q = ((w.qweight.unsqueeze(-1) >> torch.arange(0, 32, 4)) & 0xF).flatten(-2)
    back = torch.full((48, 256), -1, dtype=torch.int64)
    for p in range(24):
        for word in range(64):
            s, c = divmod(word, 16)
            bits = int(m.words[p, word]) & 0xFFFFFFFF
            for j in range(8):
                row = 16 * (p // 8) + p % 8 + 8 * (j & 1)
                col = 64 * s + 2 * (8 * (c // 4) + 2 * (c % 4) + ((j >> 1) & 1)) + (j >> 2)
                assert back[row, col] == -1
                back[row, col] = (bits >> (4 * j)) & 0xF
    assert torch.equal(back[:40], q.long()) and torch.equal(back[40:], torch.zeros(8, 256, dtype=torch.int64))


@pytest.mark.parametrize("symmetric", [True, False])
def test_layout_turns_back(symmetric):
    """:func:`int4_group` undoes :func:`mma_layout` (ragged N)."""
    gen = torch.Generator().manual_seed(3)
    w = _weight(40, 384, gen, symmetric)
    back = im.int4_group(im.mma_layout(w, torch.bfloat16))
    assert torch.equal(back.qweight, w.qweight) and torch.equal(back.scales, w.scales)
    assert torch.equal(back.zeros, w.zeros) and back.symmetric == symmetric and back.group_size == w.group_size


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_pairs_hold_scales_and_zero_points(symmetric, dtype):
    gen = torch.Generator().manual_seed(1)
    w = _weight(32, 128, gen, symmetric, dtype=dtype)
    m = im.mma_layout(w, dtype)
    lo = (m.scales & 0xFFFF).to(torch.int16).view(dtype)
    hi = (m.scales >> 16).to(torch.int16).view(dtype)
    # physical row 8T + g: rows 16T + g (low half) and 16T + g + 8 (high half)
    assert torch.equal(lo[:8], w.scales[:8]) and torch.equal(hi[:8], w.scales[8:16])
    assert torch.equal(lo[8:], w.scales[16:24]) and torch.equal(hi[8:], w.scales[24:])
    if symmetric:
        assert m.zeros is None
    else:
        magic = 128.0 if dtype == torch.bfloat16 else 1024.0
        zlo = (m.zeros & 0xFFFF).to(torch.int16).view(dtype).float()
        assert torch.equal(zlo[:8], magic + w.zeros[:8].float())


@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize("symmetric", [True, False])
def test_matches_reference(rows, symmetric):
    """Ragged N (a partial 16-row tile and a partial program), three K parts, a bias."""
    gen = torch.Generator().manual_seed(2 + rows)
    n, k = 72, 384
    w = _weight(n, k, gen, symmetric)
    x = torch.randn(rows, k, generator=gen).to(torch.bfloat16)
    bias = torch.randn(n, generator=gen).to(torch.bfloat16)
    got = im.int4_mma_matmul(x, im.mma_layout(w, torch.bfloat16), bias, num_warps=2, splits=3)
    want = qf.quant_linear(x.float(), w, bias.float())
    assert got.shape == (rows, n) and got.dtype == torch.bfloat16
    assert rel_err(got, want) < 1e-2


def test_fp16_group_64_one_part():
    gen = torch.Generator().manual_seed(5)
    n, k = 48, 256
    w = _weight(n, k, gen, symmetric=False, dtype=torch.float16, group=64)
    x = torch.randn(2, k, generator=gen).to(torch.float16)
    got = im.int4_mma_matmul(x, im.mma_layout(w, torch.float16), num_warps=1, splits=1)
    assert rel_err(got, qf.quant_linear(x.float(), w)) < 5e-3


def test_refuses_what_it_cannot_serve():
    gen = torch.Generator().manual_seed(6)
    w = _weight(32, 128, gen, symmetric=True)
    assert not im.serves(_weight(32, 96, gen, symmetric=True, group=32), torch.bfloat16)
    assert not im.serves(w, torch.float32)
    m = im.mma_layout(w, torch.bfloat16)
    with pytest.raises(ValueError, match="8 contiguous"):
        im.int4_mma_matmul(torch.zeros(9, 128, dtype=torch.bfloat16), m)
    with pytest.raises(ValueError, match="weight's dtype"):
        im.int4_mma_matmul(torch.zeros(1, 128, dtype=torch.float16), m)


@gpu
@needs_cuda
@pytest.mark.parametrize("rows", [1, 2, 5, 8])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_matches_reference(rows, symmetric, dtype):
    """The PTX (mma.sync on the layout) against the reference and against the emulation's
    sums: ragged N, K parts, unrolled or not."""
    gen = torch.Generator(device="cuda").manual_seed(rows)
    n, k = 1000, 1536
    w = _weight(n, k, gen, symmetric, dtype=dtype, device="cuda")
    m = im.mma_layout(w, dtype)
    x = torch.randn(rows, k, generator=gen, device="cuda").to(dtype)
    bias = torch.randn(n, generator=gen, device="cuda").to(dtype)
    want = qf.quant_linear(x.float(), w, bias.float())
    for warps, splits, unroll in ((8, None, 2), (4, 3, 1), (2, 1, 3)):
        got = im.int4_mma_matmul(x, m, bias, num_warps=warps, splits=splits, unroll=unroll)
        assert rel_err(got, want) < 1e-2, (warps, splits, unroll)


@gpu
@needs_cuda
def test_gpu_27b_shapes():
    gen = torch.Generator(device="cuda").manual_seed(9)
    for n, k in ((16384, 5120), (5120, 6144), (34816, 5120), (5120, 17408), (14336, 5120)):
        w = _weight(n, k, gen, symmetric=True, device="cuda")
        x = torch.randn(1, k, generator=gen, device="cuda").to(torch.bfloat16)
        got = im.int4_mma_matmul(x, im.mma_layout(w, torch.bfloat16))
        assert rel_err(got, qf.quant_linear(x.float(), w)) < 1e-2, (n, k)


def test_quant_matmul_takes_the_mma_copy(monkeypatch):
    """A weight carrying its MMA copy multiplies one to eight rows from it, more rows from
    the row-major words; ``with_mma_layout`` makes none off CUDA."""
    from dataclasses import replace

    from ninfer_kernels import quant_rows
    from ninfer_kernels.triton import quant_gemm as qg

    gen = torch.Generator().manual_seed(7)
    w = _weight(48, 256, gen, symmetric=True)
    monkeypatch.setenv("NINFER_INT4_MMA", "1")
    assert quant_rows.with_mma_layout(torch.nn.Module(), "w", w).mma is None  # CPU: nothing made
    fast = replace(w, mma=im.mma_layout(w, torch.bfloat16))
    calls = []
    real = im.int4_mma_matmul
    monkeypatch.setattr(im, "int4_mma_matmul", lambda *a, **k: calls.append(a[0].shape[0]) or real(*a, **k))
    for rows in (1, 8, 9):
        x = torch.randn(rows, 256, generator=gen).to(torch.bfloat16)
        assert rel_err(qg.quant_matmul(x, fast), qf.quant_linear(x.float(), w)) < 1e-2
    assert calls == [1, 8]
