"""The decode step's one-launch attention (q/k norm, RoPE, the KV write, attention and the
split merge) against the unfused references, in Triton's interpreter without CUDA; the
``gpu`` test repeats it at real shapes."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from _attention_cases import CASES, DEVICE, TOL, attention_case, decode_case, gpu, needs_cuda, rel_err  # noqa: E402
from ninfer_kernels import attention, decode_attention, ops  # noqa: E402
from ninfer_kernels.triton import counters as counters_module  # noqa: E402
from ninfer_kernels.triton import decode_attention as t_decode_attention  # noqa: E402
from ninfer_kernels.triton import paged_attention as t_attention  # noqa: E402

torch.set_num_threads(2)


@pytest.mark.parametrize(
    "contexts,page,heads,head_dim,rotary_dim,dtype,splits",
    [
        ([5, 17, 0, 150], 16, (8, 2), 16, 16, torch.float32, 1),
        ([5, 17, 0, 150], 16, (8, 2), 16, 16, torch.float32, 3),
        ([5, 17, 0, 150], 4, (8, 2), 16, 8, torch.float32, 8),  # partial rotary; most splits empty
        ([40, 200], 1, (6, 1), 32, 32, torch.float32, 2),  # 6-way group: padded to 8 rows
        ([63, 64, 129], 16, (8, 8), 24, 12, torch.bfloat16, 4),  # head_dim not a power of two
        # small key tiles, a merge in two passes, and a sequence whose 31 other splits exit
        ([1000, 7, 600], 16, (8, 2), 16, 16, torch.float32, 32),
    ],
)
def test_decode_attention_matches_reference(contexts, page, heads, head_dim, rotary_dim, dtype, splits):
    args, k_cache, v_cache, batch = decode_case(contexts, page, *heads, head_dim, rotary_dim, dtype, seed=page)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    want = decode_attention.decode_attention(*args, want_k, want_v, batch, head_dim**-0.5)
    got = t_decode_attention.decode_attention(*args, k_cache, v_cache, batch, head_dim**-0.5, num_splits=splits)
    assert got.dtype == dtype and got.shape == want.shape
    assert rel_err(got, want) < TOL[dtype]
    # the new rows went into the cache as the unfused ops store them, and nothing else did
    # (NaN marks never-written slots; keys may differ in the last bit of the norm's sum)
    torch.testing.assert_close(k_cache, want_k, atol=TOL[dtype], rtol=TOL[dtype], equal_nan=True)
    assert torch.equal(v_cache.nan_to_num(7.0), want_v.nan_to_num(7.0))
    counters = counters_module._buffers.get(("decode_attention", got.device))
    assert counters is None or not counters.any()  # the merging program reset every counter


@pytest.mark.parametrize("contexts", [[1000, 7, 600], [5000, 300]], ids=["short", "long"])
@pytest.mark.parametrize("one_pass_keys", ["1", "128"], ids=["two-passes", "one-pass"])
@pytest.mark.parametrize("merge_splits", ["16", "4"], ids=["merge16", "merge4"])
def test_short_contexts_merge_in_one_pass(one_pass_keys, merge_splits, contexts, monkeypatch):
    """With 32 splits, 1,000 and 600 keys fill 32 and 19 of them (a merge in two passes);
    with NINFER_DECODE_ONE_PASS_KEYS=128 no more than 16 hold keys, merged in one pass, and
    5,000 keys still fill all 32 (the online merge's two passes). At four partials a pass
    (NINFER_DECODE_MERGE_SPLITS=4) the general merge runs eight passes after the
    log-sum-exps, and the one-pass rule gives 1,000 and 600 keys 8 and 5 splits, merged in
    two running passes (5,000 keys: eight). Each way the rows are the reference's, the
    merging programs reset their counters, and the cache is the same."""
    monkeypatch.setenv("NINFER_DECODE_ONE_PASS_KEYS", one_pass_keys)
    monkeypatch.setenv("NINFER_DECODE_MERGE_SPLITS", merge_splits)
    args, k_cache, v_cache, batch = decode_case(contexts, 16, 8, 2, 16, 16, torch.float32, seed=16)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    want = decode_attention.decode_attention(*args, want_k, want_v, batch, 0.25)
    got = t_decode_attention.decode_attention(*args, k_cache, v_cache, batch, 0.25, num_splits=32)
    assert rel_err(got, want) < TOL[torch.float32]
    assert torch.equal(v_cache.nan_to_num(7.0), want_v.nan_to_num(7.0))
    counters = counters_module._buffers.get(("decode_attention", got.device))
    assert counters is None or not counters.any()


def test_the_table_split_count_merges_in_running_passes():
    """At 64 splits (the H200 table's batch-1 count once the max context passes 16k keys)
    9,000 keys fill 57 of them, merged by the default rule in four passes with a running
    max, while 40 keys fill two; the rows are still the reference's."""
    args, k_cache, v_cache, batch = decode_case([9000, 40], 16, 8, 2, 16, 16, torch.float32, seed=17)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    want = decode_attention.decode_attention(*args, want_k, want_v, batch, 0.25)
    got = t_decode_attention.decode_attention(*args, k_cache, v_cache, batch, 0.25, num_splits=64)
    assert rel_err(got, want) < TOL[torch.float32]
    counters = counters_module._buffers.get(("decode_attention", got.device))
    assert counters is None or not counters.any()


def test_the_split_switch_takes_the_place_of_the_heuristic(monkeypatch):
    args, k_cache, v_cache, batch = decode_case([40, 200], 1, 6, 1, 32, 32, torch.float32, seed=1)
    want = t_decode_attention.decode_attention(*args, k_cache.clone(), v_cache.clone(), batch, 0.2, num_splits=4)
    monkeypatch.setenv("NINFER_DECODE_SPLITS", "4")
    calls = []
    real = t_decode_attention._decode_kernel
    monkeypatch.setattr(t_decode_attention, "_decode_kernel", type("Spy", (), {
        "__getitem__": lambda self, grid: calls.append(grid) or real[grid]})())
    got = t_decode_attention.decode_attention(*args, k_cache, v_cache, batch, 0.2)
    assert calls[0][2] == 4 and torch.equal(got, want)


@pytest.mark.parametrize("dtype,splits", [(torch.float32, 1), (torch.float32, 3), (torch.bfloat16, 1),
                                          (torch.bfloat16, 4)])
def test_decode_attention_applies_the_output_gate(dtype, splits):
    """Gated attention's ``sigmoid(gate)``, from a strided view of the projection as the
    model passes it, applied as the kernel stores its rows (no splits) or merges them: what
    the unfused product gives (bf16: the attention output and the sigmoid each rounded
    first, as there)."""
    args, k_cache, v_cache, batch = decode_case([5, 17, 0, 150], 16, 6, 2, 16, 16, dtype, seed=9)
    gen = torch.Generator().manual_seed(4)
    gate = (2 * torch.randn(4, 6, 32, generator=gen)).to(DEVICE, dtype)[..., 16:]
    ungated = t_decode_attention.decode_attention(*args, k_cache.clone(), v_cache.clone(), batch, 0.25,
                                                  num_splits=splits)
    got = t_decode_attention.decode_attention(*args, k_cache, v_cache, batch, 0.25, gate=gate, num_splits=splits)
    want = attention.output_gate(ungated, gate)
    assert got.dtype == dtype
    if dtype == torch.float32:
        assert rel_err(got, want) < 1e-6
    else:  # Triton's interpreter truncates to bf16 where the GPU rounds: up to two last bits
        torch.testing.assert_close(got, want, atol=0, rtol=2**-6)
    assert rel_err(got, ungated) > 0.1
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    assert rel_err(decode_attention.decode_attention(*args, ref_k, ref_v, batch, 0.25, gate=gate), got) < TOL[dtype]


@pytest.mark.parametrize(
    "contexts,tokens,page,heads,dtype,splits,gated,rotary",
    [
        ([5, 17, 0, 150], 4, 16, (8, 2), torch.float32, 1, False, 16),
        ([5, 17, 0, 150], 4, 16, (8, 2), torch.float32, 3, True, 16),  # new keys split across two ranges
        ([60, 1000], 2, 4, (6, 1), torch.float32, 8, True, 16),  # 6-way group: 12 rows padded to 16
        ([63, 129], 6, 16, (4, 2), torch.bfloat16, 4, False, 16),  # k = 5 drafts
        ([40, 300], 3, 16, (4, 2), torch.float32, 4, False, 8),  # partial rotary; 3 keys in a 4-row tile
    ],
)
def test_verify_rows_take_the_one_launch_path(contexts, tokens, page, heads, dtype, splits, gated, rotary):
    """Speculative verify rows (``tokens`` a sequence, each at its own position) through the
    decode kernel: each row sees the cached keys and the new ones up to its own (causal
    among the new), every new key and value is stored as the unfused ops store them, and
    the output gate and split merge cover every row."""
    args, k_cache, v_cache, batch = decode_case(contexts, page, *heads, 16, rotary, dtype, seed=page + tokens,
                                                tokens=tokens)
    gate = None
    if gated:
        gen = torch.Generator().manual_seed(6)
        gate = (2 * torch.randn(len(contexts) * tokens, heads[0], 32, generator=gen)).to(DEVICE, dtype)[..., 16:]
    want_k, want_v = k_cache.clone(), v_cache.clone()
    want = decode_attention.decode_attention(*args, want_k, want_v, batch, 0.25, gate=gate)
    got = t_decode_attention.decode_attention(*args, k_cache, v_cache, batch, 0.25, gate=gate, num_splits=splits)
    assert got.shape == want.shape and rel_err(got, want) < TOL[dtype]
    torch.testing.assert_close(k_cache, want_k, atol=TOL[dtype], rtol=TOL[dtype], equal_nan=True)
    assert torch.equal(v_cache.nan_to_num(7.0), want_v.nan_to_num(7.0))
    counters = counters_module._buffers.get(("decode_attention", got.device))
    assert counters is None or not counters.any()


def test_verify_rows_past_the_tile_take_the_unfused_path():
    """More (token, head) rows a KV head than a program holds: the kernel refuses, and
    :func:`fits_rows` tells the KV cache so beforehand."""
    assert t_decode_attention.fits_rows(8, 4, fused_verify=True) and t_decode_attention.fits_rows(64, 1)
    assert not t_decode_attention.fits_rows(6, 6, fused_verify=True)
    assert not t_decode_attention.fits_rows(1, 7, fused_verify=True)
    # off (the default since session 35's rounds): verify rows never take it, decode steps do
    assert not t_decode_attention.fits_rows(8, 4, fused_verify=False)
    assert t_decode_attention.fits_rows(64, 1, fused_verify=False)
    args, k_cache, v_cache, batch = decode_case([9, 30], 16, 12, 1, 16, 16, torch.float32, seed=3, tokens=4)
    with pytest.raises(ValueError, match="same number of rows"):
        t_decode_attention.decode_attention(*args, k_cache, v_cache, batch, 0.25)


def test_decode_attention_padding_rows_store_nothing():
    args, k_cache, v_cache, batch = decode_case([9, 30, 2], 4, 4, 2, 16, 16, torch.float32, seed=5, pad=1)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    want = decode_attention.decode_attention(*args, want_k, want_v, batch, 0.25)
    got = t_decode_attention.decode_attention(*args, k_cache, v_cache, batch, 0.25, num_splits=2)
    assert rel_err(got[:-1], want[:-1]) < TOL[torch.float32]
    assert torch.isfinite(got[-1]).all()  # a padding row still attends (to whatever its page holds)
    # the reference skips slot -1 too, so any stray store of the padding row would differ
    torch.testing.assert_close(k_cache, want_k, atol=1e-6, rtol=1e-6, equal_nan=True)
    assert torch.equal(v_cache.nan_to_num(7.0), want_v.nan_to_num(7.0))


@gpu
@needs_cuda
@pytest.mark.parametrize("contexts", [[2047] * 8, [640], [5, 3000, 17, 64]], ids=["batch8", "batch1", "mixed"])
@pytest.mark.parametrize("merge_splits", ["", "8"], ids=["merge-default", "merge8"])
def test_decode_attention_real_shapes(contexts, merge_splits, monkeypatch):
    monkeypatch.setenv("NINFER_DECODE_MERGE_SPLITS", merge_splits)
    args, k_cache, v_cache, batch = decode_case(contexts, 16, 32, 8, 128, 128, torch.bfloat16, seed=2, device="cuda")
    want_k, want_v = k_cache.clone(), v_cache.clone()
    want = decode_attention.decode_attention(*args, want_k, want_v, batch, 128**-0.5)
    for _ in range(3):  # the split counters must come back to zero between calls
        got = ops.decode_attention(*args, k_cache, v_cache, batch, 128**-0.5)
        assert rel_err(got, want) < 1e-2
    # the output gate, as gated attention passes it (a strided view), rounded as torch rounds
    gate = torch.randn(*got.shape[:2], 2 * got.shape[2], device="cuda", dtype=got.dtype)[..., got.shape[2]:]
    gated = ops.decode_attention(*args, k_cache, v_cache, batch, 128**-0.5, gate)
    torch.testing.assert_close(gated, attention.output_gate(got, gate), atol=0, rtol=2**-7)
    torch.testing.assert_close(k_cache, want_k, atol=2e-2, rtol=2e-2, equal_nan=True)
    assert torch.equal(v_cache.nan_to_num(7.0), want_v.nan_to_num(7.0))


@gpu
@needs_cuda
@pytest.mark.parametrize("shape", [(24, 4, 256, 64), (4, 2, 128, 128), (32, 8, 128, 128)],
                         ids=["27b", "train-gpu-deep", "8b"])
@pytest.mark.parametrize("contexts", [[640], [5, 3000, 17, 64]], ids=["batch1", "mixed"])
def test_verify_rows_real_shapes(shape, contexts):
    """k = 3 verify rows (four tokens a sequence) at the real models' head shapes, with
    their launch shapes (more warps, a narrower merge), gated as gated attention passes it."""
    heads, kv_heads, head_dim, rotary = shape
    args, k_cache, v_cache, batch = decode_case(contexts, 16, heads, kv_heads, head_dim, rotary, torch.bfloat16,
                                                seed=3, device="cuda", tokens=4)
    gate = torch.randn(len(contexts) * 4, heads, 2 * head_dim, device="cuda", dtype=torch.bfloat16)[..., head_dim:]
    want_k, want_v = k_cache.clone(), v_cache.clone()
    want = decode_attention.decode_attention(*args, want_k, want_v, batch, head_dim**-0.5, gate=gate)
    for _ in range(3):  # the split counters must come back to zero between calls
        got = ops.decode_attention(*args, k_cache, v_cache, batch, head_dim**-0.5, gate)
        assert rel_err(got, want) < 1e-2
    torch.testing.assert_close(k_cache, want_k, atol=2e-2, rtol=2e-2, equal_nan=True)
    assert torch.equal(v_cache.nan_to_num(7.0), want_v.nan_to_num(7.0))


def test_attention_kernels_take_int64_context_lengths():
    """Replayed decode graphs hand the kernels int64 context lengths (see cuda_graph.py)."""
    args, k_cache, v_cache, batch = decode_case([5, 70, 0], 16, 8, 2, 16, 16, torch.float32, seed=11)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    want = decode_attention.decode_attention(*args, want_k, want_v, batch, 0.25)
    batch.seq_lens = batch.seq_lens.to(torch.int64)
    got = t_decode_attention.decode_attention(*args, k_cache, v_cache, batch, 0.25, num_splits=2)
    assert rel_err(got, want) < TOL[torch.float32]
    q, k_cache, v_cache, batch = attention_case(CASES["decode"], 16, 8, 2, 16, torch.float32, seed=3)
    want = attention.paged_attention(q, k_cache, v_cache, batch, 0.25)
    batch.seq_lens = batch.seq_lens.to(torch.int64)
    got = t_attention.paged_attention(q, k_cache, v_cache, batch, 0.25, num_splits=2)
    assert rel_err(got, want) < TOL[torch.float32]
