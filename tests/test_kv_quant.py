"""Quantized KV formats: the codecs, the paged cache, every family through the engine, and
accuracy on a trained model (loose bounds here; docs/kv-formats.md has the measured ones)."""

from __future__ import annotations

import pytest
import torch

from ninfer import LLM, SamplingParams
from ninfer.engine.stats import ContextCacheCounters
from ninfer.model.forward_batch import ForwardBatch
from ninfer_kernels import kv_quant as kq
from ninfer_kernels.attention import attend_pages, gather_pages

pytestmark = pytest.mark.usefixtures("one_thread")  # small tensors: see conftest

FORMATS = ["int8", "fp8", "nvfp4", "k8v4"]
CODECS = {"int8": kq.INT8, "fp8": kq.FP8, "nvfp4": kq.nvfp4(0.5)}  # a global scale that is not 1


# -- codecs ------------------------------------------------------------------------------------
@pytest.mark.parametrize("name,bound", [("int8", 1 / 254), ("fp8", 1 / 16), ("nvfp4", 1 / 4)])
def test_round_trip_error_stays_within_the_format_s_step(name, bound):
    """Each element comes back within half a quantization step of its group's scale (int8),
    or a relative step of its own magnitude (fp8's 3-bit mantissa), or of its block's
    largest value (nvfp4)."""
    codec = CODECS[name]
    x = torch.randn(6, 2, 128, generator=torch.Generator().manual_seed(1)) * 4
    x[0, 0] = 0.0  # an all-zero head stays zero
    y = codec.dequantize(codec.quantize(x))
    assert torch.equal(y[0, 0], torch.zeros(128))
    if name == "int8":
        amax = x.unflatten(-1, (2, 64)).abs().amax(-1, keepdim=True)
        assert ((y - x).unflatten(-1, (2, 64)).abs() <= amax * bound + 1e-6).all()
    elif name == "fp8":
        amax = x.abs().amax(-1, keepdim=True)
        assert ((y - x).abs() <= x.abs() * bound + amax / 448 * 2**-9 + 1e-6).all()
    else:
        amax = x.unflatten(-1, (8, 16)).abs().amax(-1, keepdim=True)
        assert ((y - x).unflatten(-1, (8, 16)).abs() <= amax * bound + 1e-6).all()


def test_e2m1_rounds_to_nearest_even_and_packs_the_even_element_low():
    y = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.75, 7.0, -0.2])
    assert kq.e2m1_codes(y).tolist() == [0, 2, 2, 4, 4, 6, 6, 10, 7, 8]
    exact = torch.tensor([[0.5, -6.0] + [0.0] * 14])  # block scale 1: stored exactly
    packed, block = kq.quantize_nvfp4(exact)
    assert block.float().item() == 1.0 and packed[0, 0].item() == (1 | (15 << 4))
    assert torch.equal(kq.dequantize_nvfp4([packed, block]), exact)


def test_large_values_saturate_instead_of_becoming_nan():
    x = torch.full((1, 1, 32), 1e6)
    for codec in CODECS.values():
        assert torch.isfinite(codec.dequantize(codec.quantize(x))).all()


def test_bytes_per_head_count_values_and_scales():
    assert kq.INT8.bytes_per_head(256) == 256 + 4 * 4
    assert kq.FP8.bytes_per_head(256) == 256 + 4
    assert kq.nvfp4().bytes_per_head(256) == 128 + 16


# -- the paged cache -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def registry():
    from ninfer.plugins import load_registry

    return load_registry()


@pytest.mark.parametrize("fmt", FORMATS)
def test_cache_attends_over_exactly_what_it_stored(registry, fmt):
    """Attention reads the dequantized stored values (no other rounding), padding slots
    are never written, and a page copied out and back (the host tier) reads the same."""
    kv = registry.get("kv_dtype", fmt)
    gen = torch.Generator().manual_seed(2)
    cache = kv.allocate(4, 4, 2, 32, torch.float32, "cpu")
    assert cache.nbytes == 4 * 4 * kv.bytes_per_token(torch.float32, 2, 32)
    k, v = torch.randn(7, 2, 32, generator=gen), torch.randn(7, 2, 32, generator=gen)
    slots = torch.tensor([4, 5, 6, 7, 8, -1, 9])  # pages 1 and 2; one padding row
    cache.write(k, v, slots)
    q = torch.randn(6, 4, 32, generator=gen)
    batch = ForwardBatch(query_start=torch.tensor([0, 6], dtype=torch.int32), seq_lens=torch.tensor([6]),
                         block_tables=torch.tensor([[1, 2]], dtype=torch.int32), slot_mapping=slots[:6],
                         logits_indices=torch.arange(6), block_size=4, max_query_len=6, max_seq_len=6,
                         query_lens_host=[6], seq_lens_host=[6])
    got = cache.attend(q, batch, 0.2)
    k_deq = cache.k_codec.dequantize([gather_pages(p, batch.block_tables[0], 6) for p in cache.k_parts])
    keep = torch.tensor([0, 1, 2, 3, 4, 6])
    assert torch.allclose(k_deq, cache.k_codec.dequantize(cache.k_codec.quantize(k[keep])), atol=0, rtol=0)
    want = attend_pages(q, lambda t, n: k_deq, lambda t, n: cache.v_codec.dequantize(
        [gather_pages(p, t, n) for p in cache.v_parts]), 2, batch, 0.2)
    assert torch.equal(got, want)
    assert all(t.is_contiguous() and t.shape[0] == 4 for t in cache.page_tensors())  # copied as stored
    saved = [t[1].clone() for t in cache.page_tensors()]
    for t in cache.page_tensors():
        t[1].zero_()
    for t, s in zip(cache.page_tensors(), saved):
        t[1].copy_(s)
    assert torch.equal(cache.attend(q, batch, 0.2), got)


# -- through the engine ---------------------------------------------------------------------------
SETTINGS = dict(dtype="fp32", device="cpu", max_concurrency=3, block_size=4, max_context=128)


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe", "qwen3_5"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_every_family_serves_every_format_with_prefix_reuse(family, fmt):
    """Batched generation is deterministic, and a repeat served from cached (quantized)
    pages gives the same tokens, on the device and after its pages went to the host tier
    and came back."""
    llm = LLM(f"tiny:{family}", kv_dtype=fmt, host_kv_mib=64, **SETTINGS)
    prompts = ["the cat sat on the mat and then it", "one two three four five six seven", "x"]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    first = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    again = llm.generate(prompts[:1], params)[0]
    assert again.outputs[0].token_ids == first[0] and again.num_cached_tokens > 0
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == first
    # a pool of 64 tokens: another prompt pushes the first one's pages out to the host
    small = LLM(f"tiny:{family}", kv_dtype=fmt, host_kv_mib=64, **{**SETTINGS, "max_concurrency": 1,
                                                                     "max_context": 64, "kv_capacity": 64})
    shared = "A shared system prompt that is long enough to fill several pages of the cache."
    alone = small.generate(shared, params)[0]
    small.generate("Something else entirely, to push the shared prompt's pages out of the pool.", params)
    back = small.generate(shared, params)[0]
    counters = ContextCacheCounters.of(small.engine.scheduler)
    assert counters.spilled_pages > 0 and counters.restored_pages > 0 and back.num_cached_tokens > 0
    assert back.outputs[0].token_ids == alone.outputs[0].token_ids


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("family, spec", [("qwen3_5", "mtp"), ("qwen3", "ngram")])
def test_speculative_verify_over_every_format(family, spec, fmt):
    """Greedy verify rows over a quantized cache give the plain engine's tokens; an MTP
    head's own KV layers take the format too."""
    llm = LLM(f"tiny:{family}", kv_dtype=fmt, spec=spec, draft_tokens=2, **SETTINGS)
    plain = LLM(f"tiny:{family}", kv_dtype=fmt, **SETTINGS)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = ["abc abc abc abc", "the cat sat the cat sat the cat"]
    if spec == "mtp":
        assert all(type(layer.kv_cache).__name__ == "QuantizedKVCache"
                   for layer in llm.engine.proposer.head.attention_layers())
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == \
        [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    assert llm.engine.stats.total_drafted > 0


# -- accuracy on a trained model ------------------------------------------------------------------
#: floors for the ``test`` preset's tiny model (head dim 16, one attention layer in four,
#: so KV error moves its logits little: every format measured >= 0.999999): fp8 read back
#: without its scale measured 0.9955
ACCURACY_FLOORS = {"int8": 0.99995, "fp8": 0.99995, "k8v4": 0.99995, "nvfp4": 0.99995}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    from ninfer.cli.train import main

    out = tmp_path_factory.mktemp("trained-kv")
    main([str(out), "--preset", "test", "--seed", "0", "-q"])
    return out


def test_accuracy_on_a_trained_model_stays_near_full_precision(trained):
    from ninfer.bench.kv_accuracy import compare_logits, teacher_forced_logits

    text = "def add(a, b):\n    return a + b\n\n\nclass Point:\n    def __init__(self, x, y):\n        self.x = x\n"
    settings = dict(dtype="fp32", device="cpu", prefix_reuse=False, max_context=256)
    base = LLM(str(trained), **settings)
    ids = base.get_tokenizer().encode(text * 3)[:200]
    ref = teacher_forced_logits(base, ids, chunk=16)
    targets = torch.tensor(ids[1:])
    for fmt, floor in ACCURACY_FLOORS.items():
        got = teacher_forced_logits(LLM(str(trained), kv_dtype=fmt, **settings), ids, chunk=16)
        figures = compare_logits(ref[:-1], got[:-1], targets)
        assert figures["logits_cosine"] >= floor, (fmt, figures)
        assert abs(figures["perplexity"] / figures["perplexity_reference"] - 1) < 0.005, (fmt, figures)


# -- the Triton kernels (Triton's interpreter without a GPU) ----------------------------------------
PAIRS = {"int8": ("int8", "int8"), "fp8": ("fp8", "fp8"), "nvfp4": ("nvfp4", "nvfp4"), "k8v4": ("fp8", "nvfp4")}


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


def _one_launch_case(fmt):
    """A decode batch of four rows (the last one graph padding) over two identical caches of
    ``fmt`` that hold each sequence's earlier keys: the raw q/k/v views, the norm/RoPE
    inputs, both caches' parts, the codecs, the batch and the new rows' slots."""
    from ninfer.model.kv import HeadNormRope

    kc, vc = (CODECS[n] for n in PAIRS[fmt])
    device, dim, heads, kv_heads, page = ("cuda" if torch.cuda.is_available() else "cpu"), 32, 6, 2, 4
    gen = torch.Generator().manual_seed(8)
    lens = [37, 1, 9, 5]  # after this step; the last row is graph padding (slot -1)
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
