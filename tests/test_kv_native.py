"""The built-in ``bf16`` KV format: registration, allocation, write + attend round trip."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ninfer.model.forward_batch import ForwardBatch
from ninfer.plugins import load_registry
from ninfer_plugins.kv.native import NativeKVCache

torch.set_num_threads(2)

BLOCK, HK, H, D = 4, 2, 4, 16


@pytest.fixture(scope="module")
def native():
    return load_registry().get("kv_dtype", "bf16")


def step(table: list[int], prefix: int, new: int, pad_rows: int = 0) -> ForwardBatch:
    """One sequence owning pages ``table``: ``new`` tokens after ``prefix`` cached ones."""
    slots = [table[p // BLOCK] * BLOCK + p % BLOCK for p in range(prefix, prefix + new)] + [-1] * pad_rows
    return ForwardBatch(
        query_start=torch.tensor([0, new], dtype=torch.int32),
        seq_lens=torch.tensor([prefix + new], dtype=torch.int32),
        block_tables=torch.tensor([table], dtype=torch.int32),
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        logits_indices=torch.tensor([new - 1]),
        block_size=BLOCK,
        max_query_len=new,
        max_seq_len=prefix + new,
        query_lens_host=[new],
        seq_lens_host=[prefix + new],
    )


def causal_oracle(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """SDPA over the whole contiguous context; returns only the last ``len(q)`` rows' output."""
    n, s = q.shape[0], k.shape[0]
    def rep(t: torch.Tensor) -> torch.Tensor:  # [S, Hk, D] -> [H, S, D]
        return t.repeat_interleave(H // HK, dim=1).transpose(0, 1)

    allowed = torch.arange(s)[None, :] <= torch.arange(s - n, s)[:, None]
    return F.scaled_dot_product_attention(q.transpose(0, 1), rep(k), rep(v), attn_mask=allowed, scale=scale).transpose(0, 1)


def test_registered_through_plugin_registry(native):
    assert native.name == "bf16"
    assert native.bytes_per_token(torch.bfloat16, HK, D) == 2 * HK * D * 2
    assert native.bytes_per_token(torch.float32, HK, D) == 2 * HK * D * 4


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_allocates_in_model_dtype(native, dtype):
    cache = native.allocate(5, BLOCK, HK, D, dtype, "cpu")
    assert isinstance(cache, NativeKVCache)
    assert cache.k.dtype == cache.v.dtype == dtype
    assert cache.k.shape == (5, BLOCK, HK, D)
    assert cache.nbytes == 5 * BLOCK * native.bytes_per_token(dtype, HK, D)


def test_rejects_integer_dtype(native):
    with pytest.raises(ValueError, match="floating-point"):
        native.allocate(1, BLOCK, HK, D, torch.int8, "cpu")


def test_write_attend_round_trip(native):
    gen = torch.Generator().manual_seed(0)
    cache = native.allocate(8, BLOCK, HK, D, torch.float32, "cpu")
    table = [5, 2, 7, 0]  # shuffled pages; 14 tokens use the first four
    k = torch.randn(14, HK, D, generator=gen)
    v = torch.randn(14, HK, D, generator=gen)
    q = torch.randn(14, H, D, generator=gen)
    scale = D**-0.5

    # Prefill 10 tokens with two padding rows whose (random) K/V must never land.
    prefill = step(table, 0, 10, pad_rows=2)
    junk_k, junk_v = torch.randn(2, HK, D, generator=gen), torch.randn(2, HK, D, generator=gen)
    cache.write(torch.cat([k[:10], junk_k]), torch.cat([v[:10], junk_v]), prefill.slot_mapping)
    out = cache.attend(torch.cat([q[:10], q[:2]]), prefill, scale)
    torch.testing.assert_close(out[:10], causal_oracle(q[:10], k[:10], v[:10], scale), atol=1e-5, rtol=1e-5)
    # Only the ten real slots hold data; a -1 slot used as an index would hit the very
    # last one (page 7, offset 3), which this sequence owns but has not filled yet.
    written = torch.zeros(8 * BLOCK, dtype=torch.bool)
    written[prefill.slot_mapping[:10]] = True
    for t in (cache.k, cache.v):
        flat = t.view(-1, HK, D)
        assert torch.equal(flat[~written], torch.zeros_like(flat[~written]))
        assert flat[written].abs().sum() > 0

    # A 3-token chunk on top of the cached prefix, then one decode token.
    for prefix, new in [(10, 3), (13, 1)]:
        batch = step(table, prefix, new)
        cache.write(k[prefix : prefix + new], v[prefix : prefix + new], batch.slot_mapping)
        out = cache.attend(q[prefix : prefix + new], batch, scale)
        want = causal_oracle(q[prefix : prefix + new], k[: prefix + new], v[: prefix + new], scale)
        torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)

    # Stored values are the written ones, bit for bit (fp32 model -> fp32 cache).
    stored = cache.k.view(-1, HK, D)[torch.tensor([table[p // BLOCK] * BLOCK + p % BLOCK for p in range(14)])]
    assert torch.equal(stored, k)


def test_decode_fused_equals_the_separate_steps_and_skips_prefill(native):
    from ninfer.model.kv import HeadNormRope
    from ninfer_kernels import qk_norm_rope
    from ninfer_kernels.rope import rope_cos_sin

    gen = torch.Generator().manual_seed(4)
    table = rope_cos_sin(64, D, 10_000.0, torch.float32, "cpu")
    fused, steps = (native.allocate(6, BLOCK, HK, D, torch.float32, "cpu") for _ in range(2))
    history = torch.randn(2, 9, HK, D, generator=gen)
    for cache in (fused, steps):  # nine cached tokens on pages 3, 1, 4
        cache.write(history[0], history[1], step([3, 1, 4], 0, 9).slot_mapping)
    q = torch.randn(1, H, D, generator=gen)
    k, v = torch.randn(2, 1, HK, D, generator=gen)
    w = torch.rand(D, generator=gen) + 0.5
    batch = step([3, 1, 4], 9, 1)
    norm_rope = HeadNormRope(w, w, 1e-6, torch.tensor([9]), table, D)

    got = fused.decode_fused(q, k, v, norm_rope, batch, 0.25)
    qr, kr = qk_norm_rope.qk_norm_rope(q, k, w, w, 1e-6, torch.tensor([9]), table, D)
    steps.write(kr, v, batch.slot_mapping)
    assert torch.equal(got, steps.attend(qr, batch, 0.25))
    assert torch.equal(fused.k, steps.k) and torch.equal(fused.v, steps.v)
    # a prefill chunk is left to the separate steps
    assert fused.decode_fused(q.expand(2, H, D), k.expand(2, HK, D), v.expand(2, HK, D), norm_rope,
                              step([3, 1, 4], 8, 2), 0.25) is None
