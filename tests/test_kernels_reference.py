"""The plain-torch reference kernels against independent, naive computations."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from ninfer.model.forward_batch import ForwardBatch
from ninfer_kernels import activation, attention, norm, ops, rope

torch.set_num_threads(2)


# -- paged attention -----------------------------------------------------------


def make_batch(
    specs: list[tuple[int, int]], block_size: int, gen: torch.Generator, pad_rows: int = 0
) -> tuple[ForwardBatch, int]:
    """A batch of sequences given as (cached prefix length, new tokens), pages shuffled.

    Returns the batch and the number of pages the cache needs. ``pad_rows`` extra rows
    with slot -1 follow the real ones, as a padded (graph-captured) step has.
    """
    seq_lens = [p + n for p, n in specs]
    pages = [math.ceil(s / block_size) for s in seq_lens]
    num_blocks = sum(pages) + 3  # a few pages nobody owns
    ids = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.zeros(len(specs), max(pages), dtype=torch.int32)
    slots: list[int] = []
    for i, ((prefix, new), n) in enumerate(zip(specs, pages)):
        tables[i, :n] = torch.tensor(ids[:n], dtype=torch.int32)
        ids = ids[n:]
        slots += [int(tables[i, p // block_size]) * block_size + p % block_size for p in range(prefix, prefix + new)]
    slots += [-1] * pad_rows
    q_lens = [n for _, n in specs]
    batch = ForwardBatch(
        query_start=torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=tables,
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        logits_indices=torch.tensor(q_lens, dtype=torch.int64).cumsum(0) - 1,
        block_size=block_size,
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        query_lens_host=q_lens,
        seq_lens_host=seq_lens,
    )
    return batch, num_blocks


def context_slots(batch: ForwardBatch, i: int) -> torch.Tensor:
    """Flat slots of every context token of sequence ``i``, written out long-hand."""
    bs = batch.block_size
    return torch.tensor(
        [int(batch.block_tables[i, p // bs]) * bs + p % bs for p in range(batch.seq_lens_host[i])]
    )


def sdpa_oracle(q: torch.Tensor, keys: list, values: list, batch: ForwardBatch, scale: float) -> torch.Tensor:
    """Per-sequence SDPA on contiguous (un-paged) K/V with an offset causal mask."""
    out = torch.zeros_like(q, dtype=torch.float64)
    group = q.shape[1] // keys[0].shape[1]
    start = 0
    for k, v, q_len in zip(keys, values, batch.query_lens_host):
        s = k.shape[0]
        qi = q[start : start + q_len].double().transpose(0, 1)  # [H, q_len, D]
        ki = k.double().repeat_interleave(group, dim=1).transpose(0, 1)
        vi = v.double().repeat_interleave(group, dim=1).transpose(0, 1)
        allowed = torch.arange(s)[None, :] <= torch.arange(s - q_len, s)[:, None]
        oi = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=allowed, scale=scale)
        out[start : start + q_len] = oi.transpose(0, 1)
        start += q_len
    return out


def run_case(
    specs: list[tuple[int, int]], block_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
    seed: int, dtype: torch.dtype = torch.float32, pad_rows: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Paged attention on random K/V/Q for ``specs`` and the SDPA oracle's answer."""
    gen = torch.Generator().manual_seed(seed)
    batch, num_blocks = make_batch(specs, block_size, gen, pad_rows)
    # NaN everywhere first: any read outside a sequence's own context poisons the result.
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    keys, values = [], []
    for i, s in enumerate(batch.seq_lens_host):
        k = torch.randn(s, num_kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(s, num_kv_heads, head_dim, generator=gen).to(dtype)
        slots = context_slots(batch, i)
        k_cache.view(-1, num_kv_heads, head_dim)[slots] = k
        v_cache.view(-1, num_kv_heads, head_dim)[slots] = v
        keys.append(k)
        values.append(v)
    q = torch.randn(sum(batch.query_lens_host) + pad_rows, num_heads, head_dim, generator=gen).to(dtype)
    scale = head_dim**-0.5
    got = attention.paged_attention(q, k_cache, v_cache, batch, scale)
    return got, sdpa_oracle(q, keys, values, batch, scale)


CASES = {
    "decode_only": [(5, 1), (17, 1), (1, 1), (32, 1)],
    "prefill_only": [(0, 7), (0, 1), (0, 20)],
    "chunk_on_prefix": [(13, 9)],
    "mixed": [(0, 6), (9, 1), (16, 5), (3, 1), (0, 1), (21, 16)],
}


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (6, 1)], ids=["mha", "gqa4", "mqa"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_paged_attention_matches_sdpa(case: str, heads: tuple[int, int], block_size: int):
    got, want = run_case(CASES[case], block_size, *heads, head_dim=16, seed=block_size * 31 + heads[0])
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, atol=2e-6, rtol=2e-5)


@pytest.mark.parametrize("seed", range(6))
def test_paged_attention_random_shapes(seed):
    gen = torch.Generator().manual_seed(1000 + seed)
    r = lambda lo, hi: int(torch.randint(lo, hi + 1, (), generator=gen))  # noqa: E731
    num_kv_heads = r(1, 3)
    specs = [(r(0, 40), r(1, 12) if r(0, 1) else 1) for _ in range(r(1, 6))]
    got, want = run_case(
        specs, block_size=[1, 4, 16][seed % 3], num_heads=num_kv_heads * r(1, 4),
        num_kv_heads=num_kv_heads, head_dim=[8, 32, 64][r(0, 2)], seed=seed,
    )
    torch.testing.assert_close(got.double(), want, atol=2e-6, rtol=2e-5)


def test_paged_attention_padding_rows_are_zero():
    got, want = run_case(CASES["mixed"], 4, 8, 2, 16, seed=5, pad_rows=3)
    torch.testing.assert_close(got[:-3].double(), want[:-3], atol=2e-6, rtol=2e-5)
    assert torch.equal(got[-3:], torch.zeros_like(got[-3:]))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_paged_attention_low_precision_returns_input_dtype(dtype):
    got, want = run_case(CASES["mixed"], 4, 8, 2, 32, seed=7, dtype=dtype)
    assert got.dtype == dtype
    # Inputs are already rounded to dtype; only the final cast may add error.
    torch.testing.assert_close(got.double(), want, atol=1e-2, rtol=1e-2)


def test_write_kv_scatters_and_skips_padding():
    gen = torch.Generator().manual_seed(3)
    num_blocks, block_size, hk, d = 6, 4, 2, 8
    k_cache = torch.randn(num_blocks, block_size, hk, d, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, hk, d, generator=gen)
    k_before, v_before = k_cache.clone(), v_cache.clone()
    k = torch.randn(5, hk, d, generator=gen)
    v = torch.randn(5, hk, d, generator=gen)
    slots = torch.tensor([9, -1, 0, 23, -1])
    attention.write_kv(k_cache, v_cache, k, v, slots)

    want_k, want_v = k_before.clone(), v_before.clone()
    for row, slot in enumerate(slots.tolist()):
        if slot >= 0:
            want_k[slot // block_size, slot % block_size] = k[row]
            want_v[slot // block_size, slot % block_size] = v[row]
    assert torch.equal(k_cache, want_k)
    assert torch.equal(v_cache, want_v)
    assert not torch.equal(k_cache, k_before)  # something was written at all


def test_write_kv_casts_to_cache_dtype():
    gen = torch.Generator().manual_seed(4)
    k_cache = torch.zeros(2, 2, 1, 4, dtype=torch.bfloat16)
    v_cache = torch.zeros_like(k_cache)
    k, v = torch.randn(2, 1, 4, generator=gen), torch.randn(2, 1, 4, generator=gen)
    attention.write_kv(k_cache, v_cache, k, v, torch.tensor([3, 0]))
    assert torch.equal(k_cache[1, 1], k[0].bfloat16())
    assert torch.equal(v_cache[0, 0], v[1].bfloat16())


# -- RMSNorm, activation ----------------------------------------------------------


def naive_rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.double()
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w.double()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm(dtype):
    gen = torch.Generator().manual_seed(11)
    x = (torch.randn(7, 96, generator=gen) * 3).to(dtype)
    w = (torch.rand(96, generator=gen) + 0.5).to(dtype)
    out = norm.rms_norm(x, w, 1e-6)
    assert out.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.double(), naive_rms_norm(x, w, 1e-6), atol=tol, rtol=tol)


def test_rms_norm_with_residual_returns_sum():
    gen = torch.Generator().manual_seed(12)
    x, res = torch.randn(5, 64, generator=gen), torch.randn(5, 64, generator=gen)
    w = torch.rand(64, generator=gen) + 0.5
    out, new_res = norm.rms_norm(x, w, 1e-5, residual=res)
    assert torch.equal(new_res, x + res)
    torch.testing.assert_close(out.double(), naive_rms_norm(x + res, w, 1e-5), atol=1e-5, rtol=1e-5)


def test_silu_and_mul():
    gen = torch.Generator().manual_seed(13)
    x = torch.randn(6, 2 * 40, generator=gen) * 4
    gate, up = x[:, :40].double(), x[:, 40:].double()
    out = activation.silu_and_mul(x)
    assert out.shape == (6, 40)
    torch.testing.assert_close(out.double(), gate * torch.sigmoid(gate) * up, atol=1e-5, rtol=1e-5)
    assert activation.silu_and_mul(x.bfloat16()).dtype == torch.bfloat16


# -- RoPE -------------------------------------------------------------------------


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def naive_rope(x: torch.Tensor, positions: torch.Tensor, rotary_dim: int, base: float) -> torch.Tensor:
    """Float64 rotate-half RoPE on the first ``rotary_dim`` dims, straight from the formula."""
    inv_freq = base ** (-torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    angles = positions.double()[:, None] * inv_freq[None, :]
    cos = torch.cat([angles.cos(), angles.cos()], -1)[:, None, :]
    sin = torch.cat([angles.sin(), angles.sin()], -1)[:, None, :]
    xr = x[..., :rotary_dim].double()
    return torch.cat([xr * cos + rotate_half(xr) * sin, x[..., rotary_dim:].double()], dim=-1)


def test_rope_table_layout():
    table = rope.rope_cos_sin(300, 16, 10000.0, torch.float32, "cpu")
    assert table.shape == (300, 16)
    inv_freq = 10000.0 ** (-torch.arange(0, 16, 2, dtype=torch.float64) / 16)
    angles = torch.arange(300, dtype=torch.float64)[:, None] * inv_freq
    torch.testing.assert_close(table.double(), torch.cat([angles.cos(), angles.sin()], -1), atol=1e-4, rtol=0)


@pytest.mark.parametrize("head_dim,rotary_dim", [(32, 32), (32, 8), (64, 16)])
def test_apply_rope_matches_rotate_half(head_dim, rotary_dim):
    gen = torch.Generator().manual_seed(head_dim + rotary_dim)
    base = 1_000_000.0
    table = rope.rope_cos_sin(256, rotary_dim, base, torch.float32, "cpu")
    positions = torch.randint(0, 256, (9,), generator=gen)
    q = torch.randn(9, 4, head_dim, generator=gen)
    k = torch.randn(9, 2, head_dim, generator=gen)
    q_out, k_out = rope.apply_rope(q, k, positions, table, rotary_dim)
    torch.testing.assert_close(q_out.double(), naive_rope(q, positions, rotary_dim, base), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(k_out.double(), naive_rope(k, positions, rotary_dim, base), atol=1e-4, rtol=1e-4)
    assert torch.equal(q_out[..., rotary_dim:], q[..., rotary_dim:])  # partial rotary passes through
    assert not torch.allclose(q_out[..., :rotary_dim], q[..., :rotary_dim])


def test_apply_rope_is_bit_exact_with_transformers_qwen3():
    qwen3 = pytest.importorskip("transformers.models.qwen3.modeling_qwen3")
    from transformers import Qwen3Config

    cfg = Qwen3Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                      rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0})
    gen = torch.Generator().manual_seed(21)
    positions = torch.randint(0, 4000, (10,), generator=gen)
    q, k = torch.randn(10, 4, 32, generator=gen), torch.randn(10, 2, 32, generator=gen)
    cos, sin = qwen3.Qwen3RotaryEmbedding(cfg)(q, positions[None])
    # HF layout is [batch, heads, seq, dim].
    hf_q, hf_k = qwen3.apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    table = rope.rope_cos_sin(4000, 32, 1_000_000.0, torch.float32, "cpu")
    q_out, k_out = rope.apply_rope(q, k, positions, table, 32)
    assert torch.equal(q_out, hf_q[0].transpose(0, 1))
    assert torch.equal(k_out, hf_k[0].transpose(0, 1))


def test_rope_linear_scaling_stretches_positions():
    plain = rope.rope_cos_sin(64, 16, 10000.0, torch.float32, "cpu")
    for key in ("rope_type", "type"):  # newer and older Hugging Face spelling
        linear = rope.rope_cos_sin(128, 16, 10000.0, torch.float32, "cpu", {key: "linear", "factor": 2.0})
        assert torch.equal(linear[::2], plain)
    default = rope.rope_cos_sin(64, 16, 10000.0, torch.float32, "cpu", {"rope_type": "default", "rope_theta": 1.0})
    assert torch.equal(default, plain)


def test_rope_rejects_unsupported_scaling():
    with pytest.raises(ValueError, match="yarn"):
        rope.rope_cos_sin(16, 8, 10000.0, torch.float32, "cpu", {"rope_type": "yarn", "factor": 4.0})


# -- dispatch ---------------------------------------------------------------------


def test_ops_dispatch_by_device(monkeypatch):
    def fake(x: torch.Tensor) -> str:
        return "triton"

    monkeypatch.setitem(ops.IMPLEMENTATIONS, "silu_and_mul", {"reference": activation.silu_and_mul, "triton": None})
    assert ops.choose("silu_and_mul", "cuda") is activation.silu_and_mul  # nothing registered yet
    ops.register_triton("silu_and_mul", fake)
    assert ops.choose("silu_and_mul", "cuda") is fake
    assert ops.choose("silu_and_mul", "cpu") is activation.silu_and_mul
    x = torch.randn(3, 8)
    assert torch.equal(ops.silu_and_mul(x), activation.silu_and_mul(x))  # CPU tensor -> reference
    monkeypatch.setattr(ops, "FORCE_REFERENCE", True)
    assert ops.choose("silu_and_mul", "cuda") is activation.silu_and_mul
    with pytest.raises(KeyError):
        ops.register_triton("no_such_op", fake)


def _force_reference_flag(env_value: str | None) -> str:
    """``ops.FORCE_REFERENCE`` as seen by a fresh interpreter with the given env var."""
    env = {k: v for k, v in os.environ.items() if k != "NINFER_KERNELS"}
    if env_value is not None:
        env["NINFER_KERNELS"] = env_value
    code = "from ninfer_kernels import ops; print(ops.FORCE_REFERENCE)"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return done.stdout.strip()


def test_ops_env_var_forces_reference():
    assert _force_reference_flag("reference") == "True"
    assert _force_reference_flag(None) == "False"
