"""Triton kernels against the plain-torch references (the decode step's fused attention
has its own file, test_decode_attention_kernel.py).

Without CUDA they run in Triton's interpreter (conftest sets TRITON_INTERPRET before
any kernel module loads), so shapes stay tiny; the ``gpu`` tests repeat the
comparison at real model shapes on CUDA.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from _attention_cases import CASES, DEVICE, TOL, attention_case, gpu, needs_cuda, rel_err  # noqa: E402
from ninfer_kernels import activation, attention, norm, ops, qk_norm_rope, rope  # noqa: E402
from ninfer_kernels.triton import activation as t_activation  # noqa: E402
from ninfer_kernels.triton import kv_write as t_kv_write  # noqa: E402
from ninfer_kernels.triton import norm as t_norm  # noqa: E402
from ninfer_kernels.triton import paged_attention as t_attention  # noqa: E402
from ninfer_kernels.triton import qk_norm_rope as t_qk_norm_rope  # noqa: E402
from ninfer_kernels.triton import rope as t_rope  # noqa: E402

torch.set_num_threads(2)


# -- paged attention ----------------------------------------------------------------




@pytest.mark.parametrize(
    "case,page,heads,splits",
    [
        ("decode", 16, (8, 2), 1), ("decode", 4, (8, 2), 3), ("decode", 1, (6, 1), 2),
        ("decode", 16, (8, 2), 8),  # most splits of the short sequences are empty
        ("prefill", 4, (4, 4), 1), ("prefill", 16, (8, 2), 2),
        ("chunk_on_prefix", 1, (8, 2), 1), ("chunk_on_prefix", 16, (6, 1), 3),
        ("mixed", 4, (8, 2), 1), ("mixed", 16, (4, 4), 2), ("mixed", 1, (6, 1), None),
    ],
)
def test_paged_attention_matches_reference(case, page, heads, splits):
    q, k_cache, v_cache, batch = attention_case(CASES[case], page, *heads, 16, torch.float32, seed=page + heads[0])
    want = attention.paged_attention(q, k_cache, v_cache, batch, 0.25)
    got = t_attention.paged_attention(q, k_cache, v_cache, batch, 0.25, num_splits=splits)
    assert got.dtype == q.dtype and got.shape == want.shape
    assert rel_err(got, want) < TOL[torch.float32]


@pytest.mark.parametrize("splits", [1, 2])
def test_paged_attention_bf16_and_padding_rows(splits):
    # head_dim 24 is not a power of two: the kernel pads its tiles and masks.
    q, k_cache, v_cache, batch = attention_case(CASES["mixed"], 4, 8, 2, 24, torch.bfloat16, seed=9, pad_rows=3)
    want = attention.paged_attention(q, k_cache, v_cache, batch, 24**-0.5)
    got = t_attention.paged_attention(q, k_cache, v_cache, batch, 24**-0.5, num_splits=splits)
    assert got.dtype == torch.bfloat16
    assert rel_err(got[:-3], want[:-3]) < TOL[torch.bfloat16]
    assert torch.equal(got[-3:], torch.zeros_like(got[-3:]))


@pytest.mark.parametrize("dtype,splits", [(torch.float32, 1), (torch.float32, 3), (torch.bfloat16, 1),
                                          (torch.bfloat16, 2)])
def test_paged_attention_applies_the_output_gate(dtype, splits):
    """The prefill and verify path's gate (``sigmoid(gate)`` from a strided view of the
    projection), applied as the kernel stores its rows (no splits) or as the merge does:
    what the unfused product gives, padding rows still zero."""
    q, k_cache, v_cache, batch = attention_case(CASES["mixed"], 4, 6, 2, 16, dtype, seed=5, pad_rows=2)
    gen = torch.Generator().manual_seed(4)
    gate = (2 * torch.randn(q.shape[0], 6, 32, generator=gen)).to(DEVICE, dtype)[..., 16:]
    ungated = t_attention.paged_attention(q, k_cache, v_cache, batch, 0.25, num_splits=splits)
    got = t_attention.paged_attention(q, k_cache, v_cache, batch, 0.25, num_splits=splits, gate=gate)
    want = attention.output_gate(ungated, gate)
    assert got.dtype == dtype and rel_err(got, ungated) > 0.1
    if dtype == torch.float32:
        assert rel_err(got, want) < 1e-6
    else:  # Triton's interpreter truncates to bf16 where the GPU rounds: up to two last bits
        torch.testing.assert_close(got, want, atol=0, rtol=2**-6)
    assert torch.equal(got[-2:], torch.zeros_like(got[-2:]))
    ref = attention.paged_attention(q, k_cache, v_cache, batch, 0.25, gate=gate)
    assert rel_err(got[:-2], ref[:-2]) < TOL[dtype]


def test_split_heuristic_fills_the_gpu_only_when_needed():
    cpu = torch.device("cpu")  # counts 4 multiprocessors, so the target is 8 programs
    assert t_attention._num_splits(base_programs=2, max_seq_len=8192, device=cpu) == 4
    assert t_attention._num_splits(base_programs=1, max_seq_len=300, device=cpu) == 2  # no tiny splits
    assert t_attention._num_splits(base_programs=3, max_seq_len=8192, device=cpu) == 2  # 3, to a power of two
    assert t_attention._num_splits(base_programs=8, max_seq_len=8192, device=cpu) == 1
    # decode's own limits: shorter splits allowed
    assert t_attention._num_splits(base_programs=1, max_seq_len=300, device=cpu, max_splits=32, min_keys=64) == 4


# -- KV write ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_matches_reference_and_skips_padding(dtype):
    gen = torch.Generator().manual_seed(3)
    k_cache = torch.randn(6, 4, 2, 8, generator=gen).to(dtype)
    v_cache = torch.randn(6, 4, 2, 8, generator=gen).to(dtype)
    # k and v as strided views of one fused projection, as the attention layer passes them.
    fused = torch.randn(5, 3 * 16, generator=gen).to(dtype)
    slots = torch.tensor([9, -1, 0, 23, -1])
    k_cache, v_cache, fused, slots = (t.to(DEVICE) for t in (k_cache, v_cache, fused, slots))
    k = fused[:, 16:32].reshape(5, 2, 8)
    v = fused[:, 32:].reshape(5, 2, 8)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    attention.write_kv(want_k, want_v, k, v, slots)
    t_kv_write.write_kv(k_cache, v_cache, k, v, slots)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)


# -- norm, activation, rope --------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_reference(dtype, with_residual):
    gen = torch.Generator().manual_seed(11)
    x = (torch.randn(7, 96, generator=gen) * 3).to(dtype)
    w = (torch.rand(96, generator=gen) + 0.5).to(dtype)
    res = torch.randn(7, 96, generator=gen).to(dtype).to(DEVICE) if with_residual else None
    x, w = x.to(DEVICE), w.to(DEVICE)
    want = norm.rms_norm(x, w, 1e-6, res)
    got = t_norm.rms_norm(x, w, 1e-6, res)
    if with_residual:
        # The carried residual is the rounded sum (bit-equal on GPU; the interpreter
        # truncates float32 -> bfloat16 where CUDA rounds to nearest, hence a tolerance).
        torch.testing.assert_close(got[1], want[1], atol=0, rtol=0 if dtype == torch.float32 else 1e-2)
        got, want = got[0], want[0]
    assert got.dtype == dtype
    torch.testing.assert_close(got, want, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_sums_expert_rows_first(dtype, with_residual):
    """A MoE layer's unsummed rows [T, P, H] (ragged last program of rows): the norm sums
    them in float32, rounds, adds the residual, normalises, as summing first would."""
    gen = torch.Generator().manual_seed(13)
    t, p, h = 70, 9, 96
    rows = (torch.randn(t, p, h, generator=gen)).to(dtype).to(DEVICE)
    w = (torch.rand(h, generator=gen) + 0.5).to(dtype).to(DEVICE)
    res = torch.randn(t, h, generator=gen).to(dtype).to(DEVICE) if with_residual else None
    summed = rows.float().sum(dim=1).to(dtype)
    want = norm.rms_norm(summed, w, 1e-6, res)
    assert all(torch.equal(a, b) for a, b in zip(_as_tuple(norm.rms_norm(rows, w, 1e-6, res, expert_rows=True)),
                                                 _as_tuple(want)))
    got = t_norm.rms_norm(rows, w, 1e-6, res, expert_rows=True)
    for g, e in zip(_as_tuple(got), _as_tuple(want)):
        assert g.shape == (t, h) and g.dtype == dtype
        # the interpreter truncates float32 -> bfloat16 where CUDA rounds (see above)
        torch.testing.assert_close(g, e, atol=TOL[dtype], rtol=TOL[dtype] if dtype == torch.float32 else 1e-2)


def _as_tuple(x):
    return x if isinstance(x, tuple) else (x,)


def test_rms_norm_fit_switch_gives_the_same_rows(monkeypatch):
    # NINFER_NORM_FIT=1: programs of no more rows than the batch has (one token: one row)
    gen = torch.Generator().manual_seed(5)
    rows, res, w = torch.randn(1, 3, 256, generator=gen), torch.randn(1, 256, generator=gen), torch.randn(256)
    want = t_norm.rms_norm(rows, w, 1e-6, res, expert_rows=True)
    monkeypatch.setenv("NINFER_NORM_FIT", "1")
    got = t_norm.rms_norm(rows, w, 1e-6, res, expert_rows=True)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_rms_norm_per_head_on_strided_view():
    gen = torch.Generator().manual_seed(12)
    fused = torch.randn(5, 3 * 64, generator=gen).to(DEVICE)
    q = fused[:, :64].reshape(5, 4, 16)  # per-head q-norm input: rows are not evenly strided
    w = (torch.rand(16, generator=gen) + 0.5).to(DEVICE)
    torch.testing.assert_close(t_norm.rms_norm(q, w, 1e-6), norm.rms_norm(q, w, 1e-6), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul_matches_reference(dtype):
    gen = torch.Generator().manual_seed(13)
    x = (torch.randn(2, 3, 2 * 40, generator=gen) * 4).to(dtype).to(DEVICE)
    got = t_activation.silu_and_mul(x)
    assert got.shape == (2, 3, 40) and got.dtype == dtype
    torch.testing.assert_close(got, activation.silu_and_mul(x), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("head_dim,rotary_dim,dtype", [(32, 32, torch.float32), (32, 8, torch.float32),
                                                       (24, 12, torch.bfloat16)])
def test_apply_rope_matches_reference(head_dim, rotary_dim, dtype):
    gen = torch.Generator().manual_seed(head_dim + rotary_dim)
    table = rope.rope_cos_sin(256, rotary_dim, 1_000_000.0, torch.float32, DEVICE)
    positions = torch.randint(0, 256, (9,), generator=gen).to(DEVICE)
    fused = torch.randn(9, 8 * head_dim, generator=gen).to(dtype).to(DEVICE)
    q = fused[:, : 6 * head_dim].reshape(9, 6, head_dim)  # strided views, as after the QKV split
    k = fused[:, 6 * head_dim :].reshape(9, 2, head_dim)
    want_q, want_k = rope.apply_rope(q, k, positions, table, rotary_dim)
    got_q, got_k = t_rope.apply_rope(q, k, positions, table, rotary_dim)
    torch.testing.assert_close(got_q, want_q, atol=TOL[dtype], rtol=TOL[dtype])
    torch.testing.assert_close(got_k, want_k, atol=TOL[dtype], rtol=TOL[dtype])
    assert torch.equal(got_q[..., rotary_dim:], q[..., rotary_dim:])
    assert torch.equal(q, fused[:, : 6 * head_dim].reshape(9, 6, head_dim))  # inputs untouched


@pytest.mark.parametrize("head_dim,rotary_dim,dtype", [(32, 32, torch.float32), (32, 8, torch.float32),
                                                       (24, 12, torch.bfloat16)])
def test_qk_norm_rope_matches_reference(head_dim, rotary_dim, dtype):
    gen = torch.Generator().manual_seed(3 * head_dim + rotary_dim)
    table = rope.rope_cos_sin(256, rotary_dim, 1_000_000.0, dtype, DEVICE)
    positions = torch.randint(0, 256, (9,), generator=gen).to(DEVICE)
    fused = (torch.randn(9, 8 * head_dim, generator=gen) * 3).to(dtype).to(DEVICE)
    q = fused[:, : 6 * head_dim].reshape(9, 6, head_dim)
    k = fused[:, 6 * head_dim :].reshape(9, 2, head_dim)
    qw, kw = [(torch.rand(head_dim, generator=gen) + 0.5).to(dtype).to(DEVICE) for _ in range(2)]
    want = qk_norm_rope.qk_norm_rope(q, k, qw, kw, 1e-6, positions, table, rotary_dim)
    got = t_qk_norm_rope.qk_norm_rope(q, k, qw, kw, 1e-6, positions, table, rotary_dim)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
        torch.testing.assert_close(g, w, atol=TOL[dtype], rtol=TOL[dtype])


def test_every_op_has_a_triton_kernel():
    for op, impls in ops.IMPLEMENTATIONS.items():
        assert impls["triton"] is not None, op
        assert ops.choose(op, "cpu") is impls["reference"]


# -- real shapes on CUDA (Qwen3-8B: 32 q heads, 8 KV heads, head_dim 128) -----------------


@gpu
@needs_cuda
@pytest.mark.parametrize("splits", [1, None])
@pytest.mark.parametrize("specs", [[(2047, 1)] * 8, [(0, 1024)], [(3000, 500), (100, 1), (0, 300)]],
                         ids=["decode", "prefill", "mixed"])
def test_paged_attention_real_shapes(specs, splits):
    q, k_cache, v_cache, batch = attention_case(specs, 16, 32, 8, 128, torch.bfloat16, seed=1, pad_rows=2,
                                                device="cuda")
    want = attention.paged_attention(q, k_cache, v_cache, batch, 128**-0.5)
    got = ops.paged_attention(q, k_cache, v_cache, batch, 128**-0.5) if splits is None else \
        t_attention.paged_attention(q, k_cache, v_cache, batch, 128**-0.5, num_splits=splits)
    assert rel_err(got[:-2], want[:-2]) < 1e-2
    assert torch.equal(got[-2:], torch.zeros_like(got[-2:]))


@gpu
@needs_cuda
def test_small_kernels_real_shapes_on_cuda():
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(300, 4096, device="cuda", generator=gen, dtype=torch.bfloat16)
    res = torch.randn_like(x)
    w = torch.rand(4096, device="cuda", generator=gen, dtype=torch.bfloat16) + 0.5
    out, new_res = ops.rms_norm(x, w, 1e-6, res)
    want, want_res = norm.rms_norm(x, w, 1e-6, res)
    assert torch.equal(new_res, want_res)
    assert rel_err(out, want) < 1e-2

    gate_up = torch.randn(300, 2 * 12288, device="cuda", generator=gen, dtype=torch.bfloat16)
    assert rel_err(ops.silu_and_mul(gate_up), activation.silu_and_mul(gate_up)) < 1e-2

    q = torch.randn(300, 32, 128, device="cuda", generator=gen, dtype=torch.bfloat16)
    k = torch.randn(300, 8, 128, device="cuda", generator=gen, dtype=torch.bfloat16)
    pos = torch.randint(0, 4096, (300,), device="cuda", generator=gen)
    table = rope.rope_cos_sin(4096, 128, 1_000_000.0, torch.float32, "cuda")
    for got, want in zip(ops.apply_rope(q, k, pos, table, 128), rope.apply_rope(q, k, pos, table, 128)):
        assert rel_err(got, want) < 1e-2

    caches = [torch.randn(64, 16, 8, 128, device="cuda", generator=gen, dtype=torch.bfloat16) for _ in range(2)]
    ref = [c.clone() for c in caches]
    slots = torch.randperm(64 * 16, device="cuda", generator=gen)[:300]
    slots[::5] = -1
    kf, vf = k.float(), torch.randn(300, 8, 128, device="cuda", generator=gen)  # cast on the way in
    ops.write_kv(*caches, kf, vf, slots)
    attention.write_kv(*ref, kf, vf, slots)
    assert torch.equal(caches[0], ref[0]) and torch.equal(caches[1], ref[1])


@pytest.mark.parametrize("odd", [False, True], ids=["words", "halfwords"])
def test_copy_state_rows_matches_reference(odd):
    """Rows of pools of several shapes and dtypes copied in one launch (rows of an odd
    number of bf16 elements take the 2-byte path)."""
    from ninfer_kernels import state_rows
    from ninfer_kernels.triton import state_rows as t_state_rows

    gen = torch.Generator().manual_seed(9)
    width = 7 if odd else 8
    pools = [torch.randn(6, 3, width, generator=gen).to(DEVICE, torch.bfloat16),
             torch.randn(6, 2, 5, 4, generator=gen).to(DEVICE), torch.randn(6, width, generator=gen).to(DEVICE)]
    src = torch.tensor([1, 4, 3], device=DEVICE)
    dst = torch.tensor([5, 0, 3], device=DEVICE)  # a row onto itself: nothing moves
    want = [p.clone() for p in pools]
    state_rows.copy_rows(want, src, dst)
    t_state_rows.copy_rows(pools, src, dst)
    for got, expected in zip(pools, want):
        assert torch.equal(got, expected)
