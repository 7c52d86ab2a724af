"""What the paged and decode attention kernel tests share: varlen batches over shuffled
pages, caches NaN wherever no sequence wrote, decode steps' raw q/k/v views of a fused
projection, the tolerances and the CUDA markers."""

from __future__ import annotations

import math

import pytest
import torch

from ninfer.model.forward_batch import ForwardBatch
from ninfer_kernels import rope

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
#: per-dtype tolerance on a relative-norm error, and on elementwise comparisons
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    want = want.double()
    return float((got.double() - want).norm() / want.norm().clamp_min(1e-30))


def make_batch(specs: list[tuple[int, int]], page: int, gen: torch.Generator, pad_rows: int = 0):
    """(cached prefix, new tokens) per sequence -> batch with shuffled pages, block count."""
    seq_lens = [p + n for p, n in specs]
    pages = [math.ceil(s / page) for s in seq_lens]
    num_blocks = sum(pages) + 2
    ids = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.zeros(len(specs), max(pages) + 1, dtype=torch.int32)  # a spare column, as real tables have
    slots: list[int] = []
    for i, ((prefix, new), n) in enumerate(zip(specs, pages)):
        tables[i, :n] = torch.tensor(ids[:n], dtype=torch.int32)
        ids = ids[n:]
        slots += [int(tables[i, p // page]) * page + p % page for p in range(prefix, prefix + new)]
    q_lens = [n for _, n in specs]
    batch = ForwardBatch(
        query_start=torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=tables,
        slot_mapping=torch.tensor(slots + [-1] * pad_rows, dtype=torch.int64),
        logits_indices=torch.tensor(q_lens, dtype=torch.int64).cumsum(0) - 1,
        block_size=page, max_query_len=max(q_lens), max_seq_len=max(seq_lens),
        query_lens_host=q_lens, seq_lens_host=seq_lens,
    )
    return batch, num_blocks


def to_device(batch: ForwardBatch, device: str) -> ForwardBatch:
    for name in ("query_start", "seq_lens", "block_tables", "slot_mapping", "logits_indices"):
        setattr(batch, name, getattr(batch, name).to(device))
    return batch


def attention_case(specs, page, heads, kv_heads, head_dim, dtype, seed, pad_rows=0, device=DEVICE):
    """Random q and a cache that is NaN wherever no sequence wrote, plus the batch."""
    gen = torch.Generator().manual_seed(seed)
    batch, num_blocks = make_batch(specs, page, gen, pad_rows)
    shape = (num_blocks, page, kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    for i, s in enumerate(batch.seq_lens_host):
        slots = torch.tensor([int(batch.block_tables[i, p // page]) * page + p % page for p in range(s)])
        k_cache.view(-1, kv_heads, head_dim)[slots] = torch.randn(s, kv_heads, head_dim, generator=gen).to(dtype)
        v_cache.view(-1, kv_heads, head_dim)[slots] = torch.randn(s, kv_heads, head_dim, generator=gen).to(dtype)
    q = torch.randn(sum(batch.query_lens_host) + pad_rows, heads, head_dim, generator=gen).to(dtype)
    return q.to(device), k_cache.to(device), v_cache.to(device), to_device(batch, device)


#: (cached prefix, new tokens) per sequence; contexts past 64 keys (one key tile) reach
#: the kernel's unmasked-tile loop as well as its masked tail.
CASES = {
    "decode": [(5, 1), (17, 1), (0, 1), (150, 1)],
    "prefill": [(0, 7), (0, 20)],
    "chunk_on_prefix": [(140, 9)],
    "mixed": [(0, 6), (9, 1), (80, 5), (3, 1), (21, 16)],
}


def decode_case(contexts, page, heads, kv_heads, head_dim, rotary_dim, dtype, seed, device=DEVICE, pad=0,
                tokens=1):
    """Raw q/k/v views of a fused projection, the cache holding each sequence's earlier
    tokens (``contexts``), and a decode batch of ``tokens`` new rows a sequence (more than
    one: speculative verify rows) whose last ``pad`` rows are graph padding (slot -1)."""
    q_c, k_cache, v_cache, batch = attention_case([(c, tokens) for c in contexts], page, heads, kv_heads,
                                                  head_dim, dtype, seed, device=device)
    gen = torch.Generator().manual_seed(seed + 1)
    rows = len(contexts) * tokens
    if pad:
        batch.slot_mapping[-pad:] = -1
    fused = (torch.randn(rows, (heads + 2 * kv_heads) * head_dim, generator=gen) * 3).to(dtype).to(device)
    q = fused[:, : heads * head_dim].reshape(rows, heads, head_dim)
    k = fused[:, heads * head_dim : (heads + kv_heads) * head_dim].reshape(rows, kv_heads, head_dim)
    v = fused[:, (heads + kv_heads) * head_dim :].reshape(rows, kv_heads, head_dim)
    qw, kw = [(torch.rand(head_dim, generator=gen) + 0.5).to(dtype).to(device) for _ in range(2)]
    table = rope.rope_cos_sin(max(contexts) + tokens, rotary_dim, 10_000.0, torch.float32, device)
    positions = (batch.seq_lens.to(torch.int64)[:, None] - tokens + torch.arange(tokens, device=device)).reshape(-1)
    return (q, k, v, qw, kw, 1e-6, positions, table, rotary_dim), k_cache, v_cache, batch
