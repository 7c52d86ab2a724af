"""Quantized checkpoints on CUDA (#22): the Triton quantized GEMM and MoE kernels inside
whole models, under CUDA graphs, against eager steps and against the CPU reference path."""

from __future__ import annotations

import pytest
import torch

from ninfer import LLM, SamplingParams
from ninfer.tiny.make import make_tiny

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

QUANTS = ["fp8-block", "ct-fp8", "ct-w4a16", "modelopt-nvfp4", "awq", "gptq"]
DEV = "cuda"
SETTINGS = dict(max_concurrency=4, block_size=16, max_context=256)


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_5"])  # their attention and MLP cover the dense layers
@pytest.mark.parametrize("quant", QUANTS)
def test_quantized_model_on_cuda(tmp_path, family, quant):
    from ninfer.bench.kv_accuracy import teacher_forced_logits

    path = str(make_tiny(tmp_path / "model", family, quant=quant))
    prompts = ["the cat sat on the mat and then it", "one two three four five six", "x"]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    graphs = LLM(path, dtype="bf16", device=DEV, **SETTINGS)
    eager = LLM(path, dtype="bf16", device=DEV, cuda_graph=False, **SETTINGS)
    got = [o.outputs[0].token_ids for o in graphs.generate(prompts, params)]
    assert got == [o.outputs[0].token_ids for o in eager.generate(prompts, params)]

    cpu = LLM(path, dtype="fp32", device="cpu", prefix_reuse=False, max_context=256)
    ids = cpu.get_tokenizer().encode("def add(a, b):\n    return a + b\n" * 8)[:120]
    want = teacher_forced_logits(cpu, ids, chunk=40)
    cuda = LLM(path, dtype="bf16", device=DEV, prefix_reuse=False, max_context=256)
    have = teacher_forced_logits(cuda, ids, chunk=40).float().cpu()
    cos = torch.nn.functional.cosine_similarity(have, want, dim=-1)
    # A MoE router whose top-k has a near-tie may pick another expert in bf16 than in float32:
    # that position's logits then differ whatever the kernels do (the CPU's bf16 reference path
    # flips the same position of the AWQ tiny MoE: cosine 0.74 at one of 120). Such
    # positions (two at most) are allowed there; a broken kernel spoils far more.
    flips = 2 if family == "qwen3_moe" else 0
    assert cos.mean() > 0.99 and int((cos <= 0.95).sum()) <= flips, (quant, family, cos.mean(), cos.min())
