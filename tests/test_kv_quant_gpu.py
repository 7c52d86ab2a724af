"""Quantized KV formats through the engine on CUDA: the Triton write and attention kernels
under CUDA graphs, against eager steps and against the CPU reference path."""

from __future__ import annotations

import pytest
import torch

from ninfer import LLM, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

FORMATS = ["int8", "fp8", "nvfp4", "k8v4"]
SETTINGS = dict(dtype="fp32", max_concurrency=4, block_size=16, max_context=512)


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe", "qwen3_5"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_graph_decode_matches_eager_decode(family, fmt):
    torch.backends.cuda.matmul.allow_tf32 = False
    prompts = ["the cat sat on the mat and then it", "one two three four five six seven eight", "x", "abc " * 40]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    graphs = LLM(f"tiny:{family}", kv_dtype=fmt, device="cuda", **SETTINGS)
    assert graphs.engine.runner.graphs is not None, "quantized caches must be capturable on CUDA"
    eager = LLM(f"tiny:{family}", kv_dtype=fmt, device="cuda", cuda_graph=False, **SETTINGS)
    got = [o.outputs[0].token_ids for o in graphs.generate(prompts, params)]
    assert got == [o.outputs[0].token_ids for o in eager.generate(prompts, params)]


@pytest.mark.parametrize("fmt", FORMATS)
def test_cuda_kernels_read_what_the_cpu_reference_reads(fmt):
    """Teacher-forced logits over a 300-token text: the Triton path (CUDA) and the torch
    reference (CPU) quantize and attend alike, so their logits agree closely."""
    from ninfer.bench.kv_accuracy import teacher_forced_logits

    torch.backends.cuda.matmul.allow_tf32 = False
    settings = dict(dtype="fp32", prefix_reuse=False, max_context=512)
    cpu = LLM("tiny:qwen3", kv_dtype=fmt, device="cpu", **settings)
    ids = cpu.get_tokenizer().encode("def add(a, b):\n    return a + b\n" * 20)[:300]
    want = teacher_forced_logits(cpu, ids, chunk=64)
    got = teacher_forced_logits(LLM("tiny:qwen3", kv_dtype=fmt, device="cuda", **settings), ids, chunk=64).cpu()
    cos = torch.nn.functional.cosine_similarity(got, want, dim=-1)
    assert cos.min() > 0.9999, (fmt, cos.min())
