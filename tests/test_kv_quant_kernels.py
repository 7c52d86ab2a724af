"""Quantized KV caches' Triton kernels (the write, paged attention, decode tiles and the
one-launch decode) against the references, in Triton's interpreter without a GPU and on
CUDA where there is one."""

from __future__ import annotations

import pytest
import torch

from _kv_quant_cases import CODECS, FORMATS, PAIRS
from ninfer.model.forward_batch import ForwardBatch
from ninfer_kernels import kv_quant as kq

pytestmark = pytest.mark.usefixtures("one_thread")  # small tensors: see conftest


def _parts(codec, blocks, page, heads, dim, device, values=False):
    """A cache's parts as the cache allocates them (``values``: one-byte codes stored by dim)."""
    return kq.allocate_parts(codec, blocks, page, heads, dim, device, values=values)


def _raw(t: torch.Tensor) -> torch.Tensor:
    """Stored bytes; float8's -0 (0x80) counted as +0: the GPU's conversion drops a zero's sign."""
    return t.view(torch.uint8).masked_fill(t.view(torch.uint8) == 0x80, 0) if t.dtype == torch.float8_e4m3fn else t


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dim", [32, 64])
def test_triton_write_stores_the_reference_s_bytes(fmt, dim):
    pytest.importorskip("triton")
    from ninfer_kernels.triton import kv_quant as tri

    kc, vc = (CODECS[n] for n in PAIRS[fmt])
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(3)
    k, v = (torch.randn(6, 2, dim, generator=gen) * 3).to(device), (torch.randn(6, 2, dim, generator=gen)).to(device)
    k[1, 0, :5] = torch.tensor([0.0, 2.5, -2.5, 1e5, -1e5])  # ties and saturation
    slots = torch.tensor([0, 5, -1, 7, 2, 3], device=device)
    want = [_parts(kc, 3, 4, 2, dim, device), _parts(vc, 3, 4, 2, dim, device)]  # values by token: any layout
    got = [_parts(kc, 3, 4, 2, dim, device), _parts(vc, 3, 4, 2, dim, device, values=True)]
    kq.write_kv_quant(*want, kc, vc, k, v, slots)
    tri.write_kv_quant(*got, kc, vc, k, v, slots)
    for part, (w, g) in enumerate(zip(want[0] + want[1], got[0] + got[1])):
        diff = (_raw(w) != _raw(g)).nonzero()
        assert len(diff) == 0, (fmt, part, len(diff), [(tuple(i.tolist()), w[tuple(i)].item(), g[tuple(i)].item())
                                                      for i in diff[:4]], want[0][1].flatten()[:8].tolist())


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("splits,dtype", [(1, torch.float32), (2, torch.float32), (2, torch.bfloat16)])
def test_triton_attention_reads_what_the_reference_reads(fmt, splits, dtype):
    """The kernel rounds dequantized values to the query's dtype for its products (bf16 on
    the GPU), the reference computes in float32: equal in float32, close in bf16."""
    pytest.importorskip("triton")
    from ninfer_kernels.triton import kv_quant as tri

    kc, vc = (CODECS[n] for n in PAIRS[fmt])
    device, dim, page = ("cuda" if torch.cuda.is_available() else "cpu"), 32, 4
    gen = torch.Generator().manual_seed(4)
    kp, vp = _parts(kc, 8, page, 2, dim, device), _parts(vc, 8, page, 2, dim, device, values=True)
    ctx = 13  # sequence 0: 13 keys over pages 5, 1, 6, 2; sequence 1: a 3-row chunk over 6 keys in pages 3, 0
    k = torch.randn(ctx + 6, 2, dim, generator=gen).to(device)
    v = torch.randn(ctx + 6, 2, dim, generator=gen).to(device)
    slots = torch.tensor([5 * 4 + i for i in range(4)] + [4 + i for i in range(4)] + [24 + i for i in range(4)] + [8]
                         + [12 + i for i in range(4)] + [0, 1], device=device)
    kq.write_kv_quant(kp, vp, kc, vc, k, v, slots)
    q = torch.randn(4, 4, dim, generator=gen).to(device, dtype)  # a decode row, a 3-row chunk; 2 query heads a KV head
    batch = ForwardBatch(
        query_start=torch.tensor([0, 1, 4], dtype=torch.int32, device=device),
        seq_lens=torch.tensor([ctx, 6], dtype=torch.int32, device=device),
        block_tables=torch.tensor([[5, 1, 6, 2], [3, 0, 0, 0]], dtype=torch.int32, device=device),
        slot_mapping=torch.tensor([8, 13, 0, 1], device=device), logits_indices=torch.arange(4, device=device),
        block_size=page, max_query_len=3, max_seq_len=ctx, query_lens_host=[1, 3], seq_lens_host=[ctx, 6],
    )
    want = kq.paged_attention_quant(q, kp, vp, kc, vc, batch, 0.3).float()
    got = tri.paged_attention_quant(q, kp, vp, kc, vc, batch, 0.3, num_splits=splits).float()
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    assert torch.allclose(got, want, atol=tol, rtol=tol), (got - want).abs().max()


#: (head dim, query rows a sequence, keys a sequence, splits): a prefill chunk over three
#: 32-row query blocks beside a short chunk, verify-shaped rows (four a sequence) over split
#: keys, and a head-dim-256 chunk on the wide tiles
LONG_CASES = [(32, [70, 5], [90, 40], None), (32, [4, 4, 4], [40, 77, 20], 3), (256, [40], [60], None)]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("case", range(len(LONG_CASES)))
def test_triton_attention_over_long_chunks_verify_rows_and_wide_heads(fmt, case):
    pytest.importorskip("triton")
    from ninfer_kernels.triton import kv_quant as tri

    dim, q_lens, ctxs, splits = LONG_CASES[case]
    kc, vc = (CODECS[n] for n in PAIRS[fmt])
    device, page, kv_heads = ("cuda" if torch.cuda.is_available() else "cpu"), 16, 2
    gen = torch.Generator().manual_seed(case)
    pages = [-(-c // page) for c in ctxs]
    kp = _parts(kc, sum(pages) + 1, page, kv_heads, dim, device)
    vp = _parts(vc, sum(pages) + 1, page, kv_heads, dim, device, values=True)
    tables = torch.zeros(len(ctxs), max(pages), dtype=torch.int32)
    first = 1
    for i, (n, c) in enumerate(zip(pages, ctxs)):
        tables[i, :n] = torch.arange(first, first + n)
        first += n
        slots = torch.tensor([int(tables[i, j // page]) * page + j % page for j in range(c)], device=device)
        k, v = ((torch.randn(c, kv_heads, dim, generator=gen) * 2).to(device) for _ in range(2))
        kq.write_kv_quant(kp, vp, kc, vc, k, v, slots)
    rows = sum(q_lens)
    # the model's dtype on the GPU: float32 queries at head dim 256 overflow the prefill
    # tiles' shared memory on Hopper (no float32 model is served at that width)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    q = torch.randn(rows, 2 * kv_heads, dim, generator=gen).to(device, dtype)
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    batch = ForwardBatch(
        query_start=starts, seq_lens=torch.tensor(ctxs, dtype=torch.int32, device=device),
        block_tables=tables.to(device), slot_mapping=torch.zeros(rows, dtype=torch.int64, device=device),
        logits_indices=torch.arange(rows, device=device), block_size=page, max_query_len=max(q_lens),
        max_seq_len=max(ctxs), query_lens_host=q_lens, seq_lens_host=ctxs,
    )
    want = kq.paged_attention_quant(q, kp, vp, kc, vc, batch, 0.1).float()
    got = tri.paged_attention_quant(q, kp, vp, kc, vc, batch, 0.1, num_splits=splits).float()
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    assert torch.allclose(got, want, atol=tol, rtol=tol), (got - want).abs().max()


@pytest.mark.parametrize("fmt,dim", [(f, 32) for f in FORMATS] + [("int8", 256), ("k8v4", 256)])
def test_triton_decode_rows_take_the_decode_tiles_and_match(fmt, dim):
    """Decode batches (one query a sequence), under the heuristic's launch, a split count,
    and a tuned table's whole shape (more splits than the short sequence has tiles); at
    head dim 256 too, where int8 has four scale groups a head and nvfp4 values sixteen."""
    pytest.importorskip("triton")
    from ninfer_kernels.triton import kv_quant as tri
    from ninfer_kernels.triton.decode_launch import DecodeLaunch

    kc, vc = (CODECS[n] for n in PAIRS[fmt])
    device, page = ("cuda" if torch.cuda.is_available() else "cpu"), 4
    gen = torch.Generator().manual_seed(5)
    kp, vp = _parts(kc, 16, page, 2, dim, device), _parts(vc, 16, page, 2, dim, device, values=True)
    lens = [37, 9]
    k, v = (torch.randn(sum(lens), 2, dim, generator=gen).to(device) for _ in range(2))
    slots = torch.cat([torch.arange(37), 40 + torch.arange(9)]).to(device)
    kq.write_kv_quant(kp, vp, kc, vc, k, v, slots)
    q = torch.randn(2, 4, dim, generator=gen).to(device)
    tables = torch.tensor([list(range(10)), list(range(10, 20))], dtype=torch.int32, device=device)
    batch = ForwardBatch(
        query_start=torch.tensor([0, 1, 2], dtype=torch.int32, device=device),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=device), block_tables=tables,
        slot_mapping=torch.tensor([36, 48], device=device), logits_indices=torch.arange(2, device=device),
        block_size=page, max_query_len=1, max_seq_len=37, query_lens_host=[1, 1], seq_lens_host=lens,
    )
    want = kq.paged_attention_quant(q, kp, vp, kc, vc, batch, 0.3).float()
    for splits, launch in ((None, None), (4, None), (None, DecodeLaunch(8, 16, 2, 2))):
        got = tri.paged_attention_quant(q, kp, vp, kc, vc, batch, 0.3, num_splits=splits, launch=launch).float()
        assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), (splits, launch, (got - want).abs().max())


@pytest.mark.parametrize("fmt", ["fp8", "int8", "k8v4"])
def test_triton_decode_tiles_narrower_than_a_page(fmt):
    """32-key pages read by 16-key tiles: every other tile starts mid-page, so a key's slot
    must follow the tile's start (the one-launch decode and the attention kernel)."""
    pytest.importorskip("triton")
    from ninfer_kernels.triton import kv_quant as tri
    from ninfer_kernels.triton.decode_launch import DecodeLaunch

    kc, vc = (CODECS[n] for n in PAIRS[fmt])
    device, page, dim = ("cuda" if torch.cuda.is_available() else "cpu"), 32, 32
    gen = torch.Generator().manual_seed(6)
    kp, vp = _parts(kc, 4, page, 2, dim, device), _parts(vc, 4, page, 2, dim, device, values=True)
    lens = [57, 20]
    k, v = (torch.randn(sum(lens), 2, dim, generator=gen).to(device) for _ in range(2))
    slots = torch.cat([torch.arange(57), 96 + torch.arange(20)]).to(device)  # pages 0-1, then 3
    kq.write_kv_quant(kp, vp, kc, vc, k, v, slots)
    q = torch.randn(2, 4, dim, generator=gen).to(device)
    batch = ForwardBatch(
        query_start=torch.tensor([0, 1, 2], dtype=torch.int32, device=device),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=device),
        block_tables=torch.tensor([[0, 1], [3, 0]], dtype=torch.int32, device=device),
        slot_mapping=torch.tensor([56, 115], device=device), logits_indices=torch.arange(2, device=device),
        block_size=page, max_query_len=1, max_seq_len=57, query_lens_host=[1, 1], seq_lens_host=lens,
    )
    want = kq.paged_attention_quant(q, kp, vp, kc, vc, batch, 0.3).float()
    for launch in (DecodeLaunch(1, 16, 2, 2), DecodeLaunch(3, 16, 2, 2)):
        got = tri.paged_attention_quant(q, kp, vp, kc, vc, batch, 0.3, launch=launch).float()
        assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), (launch, (got - want).abs().max())


def test_tuned_decode_launch_scales_splits_with_the_batch():
    """A table entry serves the batches from it up to the next one, with the same number of
    programs, no more splits than min_keys allow, and a power-of-two count."""
    from ninfer_kernels.triton.decode_launch import DecodeLaunch, scaled_launch

    table = {1: DecodeLaunch(64, 32, 4, 2), 8: DecodeLaunch(16, 64, 8, 1)}
    assert scaled_launch(table, 1, 131072, 128) == table[1]
    assert scaled_launch(table, 3, 131072, 128) == DecodeLaunch(16, 32, 4, 2)  # 64 // 3 = 21 -> 16
    assert scaled_launch(table, 16, 131072, 128) == DecodeLaunch(8, 64, 8, 1)
    assert scaled_launch(table, 1, 1000, 128).splits == 8  # ceil(1000 / 128): no more splits than that
    assert scaled_launch({8: table[8]}, 4, 131072, 128) is None  # nothing at or below: the heuristic


def test_unmeasured_quantized_formats_take_fp8_s_decode_shapes(monkeypatch):
    from ninfer_kernels.triton import decode_launch as dl

    shape = dl.DecodeLaunch(64, 64, 4, 2)
    monkeypatch.setattr(dl, "device_name", lambda device: "test-device")
    monkeypatch.setattr(dl, "load_table", lambda name: {"fp8,D=256": {1: shape}})
    cuda = torch.device("cuda")
    assert dl.tuned_launch("int8", 256, 1, 131072, 128, cuda) == shape
    assert dl.tuned_launch("fp8/nvfp4", 256, 1, 131072, 128, cuda) == shape
    assert dl.tuned_launch("nvfp4", 256, 1, 131072, 128, cuda) is None  # half-byte keys: not fp8's tiles
    assert dl.tuned_launch("bfloat16", 256, 1, 131072, 128, cuda) is None  # another kernel: its own heuristic
    assert dl.tuned_launch("int8", 256, 1, 4096, 128, cuda) is None  # short contexts keep the heuristic


def _one_launch_case(fmt, lens=(37, 1, 9, 5)):
    """A decode batch of four rows (the last one graph padding) over two identical caches of
    ``fmt`` that hold each sequence's earlier keys: the raw q/k/v views, the norm/RoPE
    inputs, both caches' parts, the codecs, the batch and the new rows' slots. ``lens``:
    the sequences' lengths after this step (at most 40, 4, 12 and 8)."""
    from ninfer.model.kv import HeadNormRope

    kc, vc = (CODECS[n] for n in PAIRS[fmt])
    device, dim, heads, kv_heads, page = ("cuda" if torch.cuda.is_available() else "cpu"), 32, 6, 2, 4
    gen = torch.Generator().manual_seed(8)
    lens = list(lens)  # the last row is graph padding (slot -1)
    tables = torch.tensor([list(range(10)), [10] + [0] * 9, [11, 12, 13] + [0] * 7, [14, 15] + [0] * 8],
                          dtype=torch.int32, device=device)
    slots = [t[(n - 1) // page].item() * page + (n - 1) % page for t, n in zip(tables, lens)]
    parts = [[_parts(kc, 16, page, kv_heads, dim, device), _parts(vc, 16, page, kv_heads, dim, device, values=True)]
             for _ in range(2)]
    for i, n in enumerate(lens):  # the earlier keys of every sequence
        old = torch.tensor([tables[i, j // page].item() * page + j % page for j in range(n - 1)], dtype=torch.long)
        k, v = (3 * torch.randn(n - 1, kv_heads, dim, generator=gen) for _ in range(2))
        for k_parts, v_parts in parts:
            kq.write_kv_quant(k_parts, v_parts, kc, vc, k.to(device), v.to(device), old.to(device))
    qkv = (3 * torch.randn(4, (heads + 2 * kv_heads) * dim, generator=gen)).to(device)
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q, k, v = q.view(4, heads, dim), k.view(4, kv_heads, dim), v.view(4, kv_heads, dim)
    rot = 16
    angles = torch.arange(64).float()[:, None] * torch.rand(rot // 2, generator=gen)[None, :]
    norm = HeadNormRope(q_weight=(torch.rand(dim, generator=gen) + 0.5).to(device),
                        k_weight=(torch.rand(dim, generator=gen) + 0.5).to(device), eps=1e-6,
                        positions=torch.tensor(lens, device=device) - 1,
                        cos_sin=torch.cat([angles.cos(), angles.sin()], dim=-1).to(device), rotary_dim=rot)
    batch = ForwardBatch(
        query_start=torch.arange(5, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=device), block_tables=tables,
        slot_mapping=torch.tensor(slots[:3] + [-1], device=device), logits_indices=torch.arange(4, device=device),
        block_size=page, max_query_len=1, max_seq_len=max(lens), query_lens_host=[1] * 4, seq_lens_host=lens,
    )
    return q, k, v, norm, parts, kc, vc, batch, slots


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("splits", [1, 3, 16, 32])
def test_triton_one_launch_decode_matches_the_steps(fmt, splits):
    """Decode in one launch (norm, RoPE, quantized write, attention, split merge): the
    reference's output and stored bytes, a padding row that stores nothing, and every split
    counter back at zero (16 splits: most of the short sequences' splits exit at once; 32:
    past ``MERGE_INSIDE_SPLITS``, a second kernel merges)."""
    pytest.importorskip("triton")
    from ninfer_kernels.triton import counters
    from ninfer_kernels.triton import kv_quant_decode as tri

    q, k, v, norm, parts, kc, vc, batch, slots = _one_launch_case(fmt)
    want = kq.decode_attention_quant(q, k, v, norm, *parts[0], kc, vc, batch, 0.3)
    got = tri.decode_attention_quant(q, k, v, norm, *parts[1], kc, vc, batch, 0.3, num_splits=splits)
    assert torch.allclose(got[:3], want[:3], atol=1e-4, rtol=1e-4), (got - want).abs().max()
    # nothing but the new rows was written, and those as the reference stores them (up to the
    # last bit of the norm's sum on the GPU, which may move a scale)
    kept = torch.ones(16 * batch.block_size, dtype=torch.bool, device=q.device)
    kept[slots[:3]] = False
    for part, (w, g) in enumerate(zip(parts[0][0] + parts[0][1], parts[1][0] + parts[1][1])):
        assert torch.equal(_raw(w).flatten(0, 1)[kept], _raw(g).flatten(0, 1)[kept]), (fmt, part)
    for codec, w, g in ((kc, parts[0][0], parts[1][0]), (vc, parts[0][1], parts[1][1])):
        assert torch.allclose(codec.dequantize(g), codec.dequantize(w), atol=1e-2, rtol=1e-2)
    buffer = counters._buffers.get(("decode_attention_quant", got.device))
    assert buffer is None or not buffer.any()


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("splits", [1, 3, 32])
def test_triton_one_launch_decode_applies_the_output_gate(fmt, splits):
    """Gated attention's ``sigmoid(gate)`` (a strided view, as it comes out of the
    projection) applied where the one-launch kernel stores its output (no splits, and
    the last split's merge) or after the second merge kernel (32 splits): the reference's
    gated output, and not the ungated one."""
    pytest.importorskip("triton")
    from ninfer_kernels.attention import output_gate
    from ninfer_kernels.triton import kv_quant_decode as tri

    q, k, v, norm, parts, kc, vc, batch, _ = _one_launch_case(fmt)
    gen = torch.Generator().manual_seed(3)
    gate = (2 * torch.randn(q.shape[0], q.shape[1], 2 * q.shape[2], generator=gen)).to(q.device)[..., q.shape[2]:]
    want = kq.decode_attention_quant(q, k, v, norm, *parts[0], kc, vc, batch, 0.3, gate=gate)
    got = tri.decode_attention_quant(q, k, v, norm, *parts[1], kc, vc, batch, 0.3, gate=gate, num_splits=splits)
    assert torch.allclose(got[:3], want[:3], atol=1e-4, rtol=1e-4), (got - want).abs().max()
    ungated = kq.decode_attention_quant(q, k, v, norm, *parts[0], kc, vc, batch, 0.3)
    assert torch.equal(want, output_gate(ungated, gate))
    assert not torch.allclose(got[:3], ungated[:3], atol=1e-2)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("splits", [1, 3])
def test_triton_kernels_ignore_what_slots_past_a_sequence_hold(fmt, splits):
    """The kernels read a masked tile's codes whole, past a sequence's end too (one-byte
    values lie by dim, where a mask by token splits the copies into single bytes). There, a
    page may hold what an earlier request stored: here non-finite keys and values, through
    both writers. The outputs stay finite and equal the reference's on a clean cache."""
    pytest.importorskip("triton")
    from ninfer_kernels.triton import kv_quant as tri_write
    from ninfer_kernels.triton import kv_quant_decode as tri

    lens = [38, 3, 10, 6]  # the new keys share their pages with cached ones and stale slots
    q, k, v, norm, parts, kc, vc, batch, _ = _one_launch_case(fmt, lens)
    page, device = batch.block_size, q.device
    stale = torch.tensor([int(batch.block_tables[i, j // page]) * page + j % page
                          for i, n in enumerate(lens) for j in range(n - 1, -(-n // page) * page)], device=device)
    bad = torch.full((len(stale), *k.shape[1:]), float("nan"), device=device)
    bad[::3] = float("inf")
    bad[1::3] = -float("inf")
    for i, writer in enumerate((kq.write_kv_quant, tri_write.write_kv_quant)):  # what either writer stores
        writer(*parts[1], kc, vc, bad[i::2], bad[i::2], stale[i::2])
    for codes in (parts[1][0][0], parts[1][1][0]):  # never a NaN code (Triton's interpreter reads one as 480)
        assert codes.dtype != torch.float8_e4m3fn or not codes.float().isnan().any()
    want = kq.decode_attention_quant(q, k, v, norm, *parts[0], kc, vc, batch, 0.3)
    got = tri.decode_attention_quant(q, k, v, norm, *parts[1], kc, vc, batch, 0.3, num_splits=splits)
    assert torch.isfinite(got[:3]).all() and torch.allclose(got[:3], want[:3], atol=1e-4, rtol=1e-4)
    rows = torch.randn(q.shape, generator=torch.Generator().manual_seed(9)).to(device)  # the same caches, read again
    want = kq.paged_attention_quant(rows, *parts[0], kc, vc, batch, 0.3)
    got = tri_write.paged_attention_quant(rows, *parts[1], kc, vc, batch, 0.3, num_splits=splits)
    assert torch.isfinite(got[:3]).all() and torch.allclose(got[:3], want[:3], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("fmt", FORMATS)
def test_triton_attention_in_fp16_products_stays_at_bf16_accuracy(fmt, monkeypatch):
    """bf16 queries on the GPU multiply in fp16 (``HALF_PRODUCTS``): forced on here, the
    kernel still matches the float32 reference within bf16's tolerance."""
    pytest.importorskip("triton")
    from ninfer_kernels.triton import kv_quant as tri

    monkeypatch.setattr(tri, "_half_products", lambda q: q.dtype == torch.bfloat16)
    kc, vc = (CODECS[n] for n in PAIRS[fmt])
    device, dim, page = ("cuda" if torch.cuda.is_available() else "cpu"), 32, 4
    gen = torch.Generator().manual_seed(6)
    kp, vp = _parts(kc, 16, page, 2, dim, device), _parts(vc, 16, page, 2, dim, device, values=True)
    k, v = (4 * torch.randn(40, 2, dim, generator=gen).to(device) for _ in range(2))
    kq.write_kv_quant(kp, vp, kc, vc, k, v, torch.arange(40, device=device))
    q = torch.randn(2, 4, dim, generator=gen).to(device, torch.bfloat16)
    tables = torch.tensor([list(range(10)), list(range(10))], dtype=torch.int32, device=device)
    batch = ForwardBatch(
        query_start=torch.tensor([0, 1, 2], dtype=torch.int32, device=device),
        seq_lens=torch.tensor([40, 23], dtype=torch.int32, device=device), block_tables=tables,
        slot_mapping=torch.tensor([39, 22], device=device), logits_indices=torch.arange(2, device=device),
        block_size=page, max_query_len=1, max_seq_len=40, query_lens_host=[1, 1], seq_lens_host=[40, 23],
    )
    want = kq.paged_attention_quant(q.float(), kp, vp, kc, vc, batch, 0.3)
    for splits in (1, 4):
        got = tri.paged_attention_quant(q, kp, vp, kc, vc, batch, 0.3, num_splits=splits).float()
        assert torch.allclose(got, want, atol=3e-2, rtol=3e-2), (splits, (got - want).abs().max())
