"""Quantized KV formats: the codecs, the paged cache, every family through the engine, and
accuracy on a trained model (loose bounds here; docs/kv-formats.md has the measured ones).
The Triton kernels' tests are ``test_kv_quant_kernels.py``."""

from __future__ import annotations

import pytest
import torch

from _kv_quant_cases import CODECS, FORMATS
from ninfer import LLM, SamplingParams
from ninfer.engine.stats import ContextCacheCounters
from ninfer.model.forward_batch import ForwardBatch
from ninfer_kernels import kv_quant as kq
from ninfer_kernels.attention import attend_pages, gather_pages

pytestmark = pytest.mark.usefixtures("one_thread")  # small tensors: see conftest


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
