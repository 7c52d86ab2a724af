"""The few-row linear kernel against ``F.linear`` (in Triton's interpreter without a GPU)
and its per-shape choice between itself and cuBLAS."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from ninfer_kernels.triton import skinny_linear as sk  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: see conftest
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    want = want.double()
    return float((got.double() - want).norm() / want.norm().clamp_min(1e-30))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("rows,column_major,bias", [(1, True, False), (5, False, True), (16, True, True)])
@pytest.mark.parametrize("swap", [False, True], ids=["", "swapped"])
def test_skinny_linear_equals_f_linear(rows, column_major, bias, splits, dtype, swap):
    """Ragged N and K (masked tails), both weight layouts, a bias, the split-K sum, the
    product as x W^T and as (W x^T)^T."""
    gen = torch.Generator().manual_seed(rows + splits)
    n, k = 40, 72
    x = torch.randn(rows, k, generator=gen).to(dtype)
    w = (torch.randn(n, k, generator=gen) * k**-0.5).to(dtype)
    if column_major:
        w = w.t().contiguous().t()
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    config = sk.SkinnyConfig(BLOCK_N=16, BLOCK_K=16, SPLITS=splits, num_warps=2, num_stages=2, swap=swap)
    want = F.linear(x.float(), w.float(), None if b is None else b.float())
    got = sk.skinny_linear(x, w, b, config)
    assert got.dtype == dtype and got.shape == (rows, n)
    assert rel_err(got, want) <= TOL[dtype]
    # the arrival counters are zero again: a second call sums the same way
    assert torch.equal(sk.skinny_linear(x, w, b, config), got)


def test_skinny_linear_refuses_too_many_rows():
    with pytest.raises(ValueError, match="at most 16 rows"):
        sk.skinny_linear(torch.zeros(17, 8), torch.zeros(8, 8), None, sk.SkinnyConfig(16, 16))


def test_choice_follows_the_table_by_shape_and_rows(monkeypatch, tmp_path):
    entry = {"BLOCK_N": 32, "BLOCK_K": 128, "SPLITS": 2, "num_warps": 4, "num_stages": 3}
    (tmp_path / "cuda.json").write_text(json.dumps({"_comment": "test", "N=64,K=32,float32": {"1": entry, "4": entry}}))
    monkeypatch.setattr(sk, "CONFIG_DIR", tmp_path)
    monkeypatch.setattr(sk, "device_name", lambda device: device.type)
    sk.load_table.cache_clear()

    class FakeCuda:  # only the attributes choose() reads
        def __init__(self, rows, n, k):
            self.shape, self.device, self.dtype = (rows, k), torch.device("cuda"), torch.float32

        def dim(self):
            return 2

    def pick(rows, n=64, k=32):
        return sk.choose(FakeCuda(rows, n, k), torch.empty(n, k))

    try:
        assert pick(1) == sk.SkinnyConfig(**entry)
        assert pick(3) == sk.SkinnyConfig(**entry)       # the nearest row count at or above
        assert pick(5) is None                           # past the table: cuBLAS
        assert pick(1, n=128) is None                    # shape not tuned: cuBLAS
        assert pick(17) is None                          # too many rows for the kernel
        monkeypatch.setenv("NINFER_SKINNY_LINEAR", "0")
        assert pick(1) is None
    finally:
        sk.load_table.cache_clear()


def test_cpu_tensors_take_f_linear():
    x, w = torch.randn(2, 8), torch.randn(4, 8)
    assert sk.choose(x, w) is None
    assert torch.equal(sk.linear(x, w), F.linear(x, w))


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 8])
def test_skinny_linear_on_the_gpu_equals_cublas(rows):
    x = torch.randn(rows, 2048, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(12352, 2048, device="cuda", dtype=torch.bfloat16) * 0.02).t().contiguous().t()
    want = F.linear(x.float(), w.float())
    for splits in (1, 4):
        for swap in (False, True):
            got = sk.skinny_linear(x, w, None, sk.SkinnyConfig(64, 128, splits, swap=swap))
            assert rel_err(got, want) <= 1e-2
