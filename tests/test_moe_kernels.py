"""Mixture-of-experts kernels: the references against the model's per-expert loop, and
the Triton kernels (sorting by expert, the grouped and single-token expert kernels,
their launch tables) against the references; routing is in test_moe_routing.py (in Triton's interpreter
without a GPU, so shapes stay tiny; the ``gpu`` test repeats it at a real shape)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from _attention_cases import gpu, needs_cuda, rel_err
from _moe_cases import TOL, moe_weights, replayed
from ninfer_kernels import moe

pytest.importorskip("triton")

from ninfer_kernels.triton import fused_moe as t_fused  # noqa: E402
from ninfer_kernels.triton import moe_route as t_route  # noqa: E402
from ninfer_kernels.triton.moe_align_grid import align_grid  # noqa: E402
from ninfer_kernels.triton import moe_shapes as t_shapes  # noqa: E402
from ninfer_kernels.triton import moe_single_token as t_one  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: see conftest
#: several row blocks and column blocks, a K loop of several steps, and the swizzle
SMALL = t_fused.MoeConfig(16, t_fused.GemmConfig(16, 16, 2, 4, 2), t_fused.GemmConfig(16, 16, 2, 4, 2))

def check_layout(ids: torch.Tensor, num_experts: int, block_m: int, layout) -> None:
    """Every property moe_align promises, checked from its definition."""
    sorted_pairs, block_experts, num_padded = layout
    flat = ids.flatten().tolist()
    pairs = len(flat)
    rows = moe.max_padded_rows(pairs, num_experts, block_m)
    assert sorted_pairs.dtype == block_experts.dtype == num_padded.dtype == torch.int32
    assert sorted_pairs.shape == (rows,) and block_experts.shape == (rows // block_m,) and num_padded.shape == (1,)
    got, blocks = sorted_pairs.tolist(), block_experts.tolist()
    row = 0
    for e in range(num_experts):
        members = [p for p, x in enumerate(flat) if x == e]
        if not members:
            continue
        run = -(-len(members) // block_m) * block_m
        assert got[row:row + run] == members + [pairs] * (run - len(members))
        assert blocks[row // block_m:(row + run) // block_m] == [e] * (run // block_m)
        row += run
    assert int(num_padded) == row
    assert got[row:] == [pairs] * (rows - row)
    assert blocks[row // block_m:] == [-1] * (rows // block_m - row // block_m)


# -- references --------------------------------------------------------------------


@pytest.mark.parametrize("shared", [False, True])
def test_reference_fused_moe_equals_the_expert_loop(shared):
    gen = torch.Generator().manual_seed(1)
    t, e, h, i, k = 12, 8, 64, 32, 3
    x = torch.randn(t, h, generator=gen)
    w13, w2, s13, s2 = moe_weights(e, h, i, gen, shared=shared)
    gate = torch.randn(h, generator=gen) if shared else None
    weights, ids = moe.moe_route(torch.randn(t, e, generator=gen), k, True, x, gate)
    got = moe.fused_moe(x, w13, w2, weights, ids, s13, s2)
    want = moe.expert_loop(x, weights[:, :k], ids[:, :k], w13, w2)
    if shared:
        g, u = (x @ s13.T).chunk(2, dim=-1)
        want = want + weights[:, k:] * ((F.silu(g) * u) @ s2.T)
    assert rel_err(got, want) <= 1e-5


@pytest.mark.parametrize("t,k,e,block_m", [(1, 1, 4, 16), (5, 3, 8, 16), (12, 9, 7, 4), (40, 4, 16, 32)])
def test_reference_align_layout(t, k, e, block_m):
    gen = torch.Generator().manual_seed(t)
    present = torch.randperm(e, generator=gen)[: max(1, e // 2)]  # half the experts get no pair
    ids = present[torch.randint(0, len(present), (t, k), generator=gen)].int()
    check_layout(ids, e, block_m, moe.moe_align(ids, e, block_m))


def test_reference_handles_no_tokens():
    sorted_pairs, block_experts, num_padded = moe.moe_align(torch.zeros(0, 3, dtype=torch.int32), 8, 16)
    assert sorted_pairs.numel() == block_experts.numel() == 0 and num_padded.tolist() == [0]
    w13, w2, _, _ = moe_weights(4, 16, 8, torch.Generator().manual_seed(0))
    out = moe.fused_moe(torch.zeros(0, 16), w13, w2, torch.zeros(0, 2), torch.zeros(0, 2, dtype=torch.int32))
    assert out.shape == (0, 16)


# -- Triton against the references -------------------------------------------------


@pytest.mark.parametrize("t,k,e,block_m,chunk", [
    (1, 9, 257, 16, 128),   # decode at the Qwen3.6 shape: every pair may be its own run
    (5, 3, 8, 16, 16),      # pairs in one chunk
    (12, 9, 7, 16, 16),     # 108 pairs: the chunk loop runs 7 times
    (11, 4, 16, 32, 32),    # a partial last chunk, some experts empty
    (12, 8, 5, 64, 128),    # runs longer than a chunk's share
    (8, 9, 257, 16, 128),   # decode batch of 8 at the Qwen3.6 shape (72 pairs)
    (2, 3, 4, 16, 16),      # every expert shared by several pairs
])
def test_triton_align_equals_reference(t, k, e, block_m, chunk):
    gen = torch.Generator().manual_seed(t * k)
    ids = torch.randint(0, e, (t, k), generator=gen, dtype=torch.int32)
    if e > 8:  # many experts but few pairs; also leave expert 0 empty
        ids = ids.clamp_min(1)
    want = moe.moe_align(ids, e, block_m)
    check_layout(ids, e, block_m, want)
    paths = [t_route._align_kernel_launch(ids, e, block_m, chunk), align_grid(ids, e, block_m, chunk)]
    if ids.numel() <= t_route.SMALL_PAIRS:
        paths.append(t_route._align_small_launch(ids, e, block_m))
    for got in paths:
        for a, b in zip(got, want):
            assert a.dtype == b.dtype and torch.equal(a, b)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[gpu, needs_cuda])])
def test_triton_align_takes_the_grid_path_for_large_batches(monkeypatch, device):
    """Prefill-sized pair counts (here 2000 tokens at k' = 9, 141 chunks, two scan steps)
    go through the four grid launches; some experts empty, some runs many chunks long."""
    ids = torch.randint(1, 200, (2000, 9), generator=torch.Generator().manual_seed(3), dtype=torch.int32)
    monkeypatch.setattr(t_route, "_align_kernel_launch", None)  # would raise if called
    got = t_route.moe_align(ids.to(device), 257, 64)
    for a, b in zip(got, moe.moe_align(ids, 257, 64)):
        assert a.dtype == b.dtype and torch.equal(a.cpu(), b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("t", [1, 12])
def test_triton_fused_moe_equals_reference(t, shared, dtype):
    gen = torch.Generator().manual_seed(t + shared)
    e, h, i, k = 8, 64, 32, 3
    x = torch.randn(t, h, generator=gen).to(dtype)
    w13, w2, s13, s2 = moe_weights(e, h, i, gen, dtype, shared)
    gate = torch.randn(h, generator=gen).to(dtype) if shared else None
    weights, ids = moe.moe_route(torch.randn(t, e, generator=gen), k, True, x, gate)
    want = moe.fused_moe(x, w13, w2, weights, ids, s13, s2)
    got = t_fused.fused_moe(x, w13, w2, weights, ids, s13, s2, config=SMALL)
    assert got.dtype == dtype and got.shape == (t, h)
    assert rel_err(got, want) <= TOL[dtype]


@pytest.mark.parametrize("t", [1, 12, 0])
def test_unsummed_expert_rows_sum_to_the_layer_output(t):
    """``summed=False`` hands back each token's weighted rows (one token's kernels, the
    grouped GEMMs, no tokens), in the reference and in Triton; their float32 sum rounded
    is the summed output exactly."""
    gen = torch.Generator().manual_seed(20 + t)
    e, h, i, k = 8, 64, 32, 3
    x = torch.randn(t, h, generator=gen).to(torch.bfloat16)
    w13, w2, s13, s2 = moe_weights(e, h, i, gen, torch.bfloat16, True)
    weights, ids = moe.moe_route(torch.randn(t, e, generator=gen), k, True, x, torch.randn(h, generator=gen))
    for fn in (moe.fused_moe, t_fused.fused_moe):
        rows = fn(x, w13, w2, weights, ids, s13, s2, summed=False)
        assert rows.shape == (t, k + 1, h) and rows.dtype == x.dtype
        assert torch.equal(rows.float().sum(dim=1).to(x.dtype), fn(x, w13, w2, weights, ids, s13, s2))


@pytest.mark.parametrize("config", [None, t_fused.MoeConfig(32, t_fused.GemmConfig(32, 32, 1, 4, 2),
                                                            t_fused.GemmConfig(16, 32, 4, 2, 3))])
def test_triton_fused_moe_ragged_shapes(config):
    """Widths that no tile divides (masked K tails), a strided x, the default config."""
    gen = torch.Generator().manual_seed(5)
    t, e, h, i, k = 9, 6, 40, 24, 2
    x = torch.randn(t, 2 * h, generator=gen)[:, ::2]
    w13, w2, s13, s2 = moe_weights(e, h, i, gen, shared=True)
    weights, ids = moe.moe_route(torch.randn(t, e, generator=gen), k, False, x, torch.randn(h, generator=gen))
    want = moe.fused_moe(x, w13, w2, weights, ids, s13, s2)
    assert rel_err(t_fused.fused_moe(x, w13, w2, weights, ids, s13, s2, config=config), want) <= 1e-5


#: several column blocks and K steps in both single-token kernels, ragged tails
ONE_SMALL = t_one.SingleTokenConfig(gate_up_n=4, gate_up_k=16, gate_up_warps=1, down_n=8, down_k=16, down_warps=2)
#: the same with both K loops staged through shared memory (on CUDA; the interpreter runs them plainly)
ONE_STAGED = t_one.SingleTokenConfig(4, 16, 1, 8, 16, 2, gate_up_stages=3, down_stages=3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("config", [ONE_SMALL, ONE_STAGED, t_one.DEFAULT_CONFIG], ids=["small", "staged", "default"])
def test_single_token_kernels_equal_reference(config, shared, dtype):
    """One token's matrix-vector kernels (ragged widths, the shared expert's strides
    copied as the dispatcher does) against the reference, rounding points included."""
    gen = torch.Generator().manual_seed(11 + shared)
    e, h, i, k = 7, 40, 24, 3
    x = torch.randn(1, 2 * h, generator=gen)[:, ::2].to(dtype)
    w13, w2, s13, s2 = moe_weights(e, h, i, gen, dtype, shared)
    gate = torch.randn(h, generator=gen).to(dtype) if shared else None
    weights, ids = moe.moe_route(torch.randn(1, e, generator=gen), k, True, x, gate)
    want = moe.fused_moe(x, w13, w2, weights, ids, s13, s2)
    if shared:
        s13, s2 = s13.contiguous(), s2.contiguous()
    rows = t_one.expert_rows_one_token(x, w13, w2, weights, ids, s13, s2, config)
    assert rows.shape == (ids.shape[1], h)
    got = t_fused.sum_pairs(rows, 1, ids.shape[1])
    assert got.dtype == dtype and got.shape == (1, h)
    assert rel_err(got, want) <= TOL[dtype]


def test_one_token_takes_the_single_token_kernels_unless_switched_off(monkeypatch):
    gen = torch.Generator().manual_seed(3)
    e, h, i, k = 6, 32, 16, 2
    x = torch.randn(1, h, generator=gen)
    w13, w2, s13, s2 = moe_weights(e, h, i, gen, shared=True)
    weights, ids = moe.moe_route(torch.randn(1, e, generator=gen), k, False, x, torch.randn(h, generator=gen))
    calls = []
    real = t_fused.expert_rows_one_token
    monkeypatch.setattr(t_fused, "expert_rows_one_token", lambda *a: calls.append(1) or real(*a))
    want = moe.fused_moe(x, w13, w2, weights, ids, s13, s2)
    assert rel_err(t_fused.fused_moe(x, w13, w2, weights, ids, s13, s2), want) <= 1e-5
    assert calls == [1]
    monkeypatch.setenv("NINFER_MOE_ONE_TOKEN", "0")
    assert rel_err(t_fused.fused_moe(x, w13, w2, weights, ids, s13, s2), want) <= 1e-5
    assert calls == [1]


# -- config selection --------------------------------------------------------------


def test_config_selection_takes_the_nearest_m_at_or_above(monkeypatch, tmp_path):
    small, big = SMALL.to_json(), t_fused.heuristic_config(8, 2, 10_000).to_json()
    key = t_fused.shape_key(9, 64, 32, 3, torch.float32)
    assert key == "E=9,H=64,I=32,k=3,fp32"
    (tmp_path / "cpu.json").write_text(json.dumps({"_comment": "x", key: {"4": small, "64": big}}))
    monkeypatch.setattr(t_shapes, "CONFIG_DIR", tmp_path)
    t_fused.load_table.cache_clear()
    try:
        pick = lambda t: t_fused.select_config(torch.device("cpu"), 9, 64, 32, 3, torch.float32, t)  # noqa: E731
        assert pick(1) == pick(4) == SMALL
        assert pick(5) == pick(64) == pick(5000) == t_fused.MoeConfig.from_json(big)
        other = t_fused.select_config(torch.device("cpu"), 9, 64, 32, 3, torch.bfloat16, 1)
        assert other == t_fused.heuristic_config(9, 3, 1)  # no entry for this shape
    finally:
        t_fused.load_table.cache_clear()


def test_shipped_h200_table_covers_both_models():
    table = t_fused.load_table("NVIDIA_H200")
    for key in ("E=257,H=2048,I=512,k=9,bf16", "E=128,H=2048,I=768,k=8,bf16"):
        assert sorted(table[key]) == [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192]
        for cfg in table[key].values():
            assert cfg.block_m >= 16 and cfg.gate_up.BLOCK_N >= 16 and cfg.down.BLOCK_K >= 16


def test_an_h100_without_tables_of_its_own_uses_the_h200s():
    """Same chip: the H200's tuned shapes stand in, for every kernel family's folder, while
    a card with its own table keeps it."""
    from ninfer_kernels.triton import decode_launch, skinny_linear, tuned_tables

    for folder in (t_shapes.CONFIG_DIR, skinny_linear.CONFIG_DIR, decode_launch.CONFIG_DIR):
        if not (folder / "NVIDIA_H100_80GB_HBM3.json").exists():
            h200 = tuned_tables.read_table(folder, "NVIDIA_H200")
            assert h200 and tuned_tables.read_table(folder, "NVIDIA_H100_80GB_HBM3") == h200
    assert tuned_tables.read_table(t_shapes.CONFIG_DIR, "NVIDIA_A100-SXM4-80GB") == {}


# -- real shapes on CUDA (Qwen3.6-35B-A3B: 256 experts + shared, H 2048, I 512, top 8) --


@gpu
@needs_cuda
@pytest.mark.parametrize("t", [1, 64, 600])
def test_fused_moe_real_shape_and_graph_capture(t):
    gen = torch.Generator(device="cuda").manual_seed(0)
    e, h, i, k = 256, 2048, 512, 8
    dtype = torch.bfloat16
    x = torch.randn(t, h, device="cuda", generator=gen, dtype=dtype)
    w13 = torch.randn(e, 2 * i, h, device="cuda", generator=gen, dtype=dtype) * h**-0.5
    w2 = torch.randn(e, h, i, device="cuda", generator=gen, dtype=dtype) * i**-0.5
    s13 = (torch.randn(h, 2 * i, device="cuda", generator=gen, dtype=dtype) * h**-0.5).T
    s2 = (torch.randn(i, h, device="cuda", generator=gen, dtype=dtype) * i**-0.5).T
    gate = torch.randn(1, h, device="cuda", generator=gen, dtype=dtype) * h**-0.5
    logits = torch.randn(t, e, device="cuda", generator=gen, dtype=dtype)

    want_w, want_ids = moe.moe_route(logits, k, True, x, gate)
    w, ids = t_route.moe_route(logits, k, True, x, gate)
    assert torch.equal(ids, want_ids) and (w - want_w).abs().max() <= 1e-5
    block_m = t_fused.select_config(x.device, e + 1, h, i, k + 1, dtype, t).block_m
    for a, b in zip(t_route.moe_align(ids, e + 1, block_m), moe.moe_align(ids, e + 1, block_m)):
        assert torch.equal(a, b)
    want = moe.fused_moe(x, w13, w2, w, ids, s13, s2)
    eager = t_fused.fused_moe(x, w13, w2, w, ids, s13, s2)
    assert rel_err(eager, want) <= 2e-2

    def step():
        rw, rids = t_route.moe_route(logits, k, True, x, gate)
        return t_fused.fused_moe(x, w13, w2, rw, rids, s13, s2)

    out = replayed(step)
    assert torch.equal(out, eager)


@gpu
@needs_cuda
def test_single_token_kernels_staged_equal_unstaged_at_the_35b_shape():
    """Both single-token K loops staged through shared memory (a config's stages): the same
    rows, bit for bit, as each tile loaded where it is used."""
    from dataclasses import replace

    gen = torch.Generator(device="cuda").manual_seed(1)
    e, h, i, k = 256, 2048, 512, 8
    dtype = torch.bfloat16
    x = torch.randn(1, h, device="cuda", generator=gen, dtype=dtype)
    w13 = torch.randn(e, 2 * i, h, device="cuda", generator=gen, dtype=dtype) * h**-0.5
    w2 = torch.randn(e, h, i, device="cuda", generator=gen, dtype=dtype) * i**-0.5
    s13 = torch.randn(2 * i, h, device="cuda", generator=gen, dtype=dtype) * h**-0.5
    s2 = torch.randn(h, i, device="cuda", generator=gen, dtype=dtype) * i**-0.5
    gate = torch.randn(1, h, device="cuda", generator=gen, dtype=dtype) * h**-0.5
    weights, ids = t_route.moe_route(torch.randn(1, e, device="cuda", generator=gen, dtype=dtype), k, True, x, gate)
    weights, ids = weights.float().contiguous(), ids.to(torch.int32).contiguous()
    plain = t_one.expert_rows_one_token(x, w13, w2, weights, ids, s13, s2, t_one.DEFAULT_CONFIG)
    staged = t_one.expert_rows_one_token(x, w13, w2, weights, ids, s13, s2,
                                         replace(t_one.DEFAULT_CONFIG, gate_up_stages=3, down_stages=3))
    assert torch.equal(plain, staged)
