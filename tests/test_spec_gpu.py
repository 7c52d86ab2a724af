"""Speculative rounds on CUDA: verify steps replayed from graphs give the eager tokens."""

from __future__ import annotations

import pytest
import torch

from ninfer import LLM, SamplingParams

from test_spec_decode import PROMPTS, ReplayProposer, _run

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
FAMILIES = ["qwen3", "qwen3_moe", "qwen3_next", "qwen3_5", "qwen3_5_moe"]
SETTINGS = dict(dtype="fp32", device="cuda", max_concurrency=4, prefill_chunk=8, block_size=16, max_context=512)


@gpu
@needs_cuda
@pytest.mark.parametrize("family", FAMILIES)
def test_graph_verify_steps_give_the_plain_greedy_tokens(family):
    torch.backends.cuda.matmul.allow_tf32 = False
    model = f"tiny:{family}"
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = LLM(model, **SETTINGS)
    expected = _run(plain, PROMPTS, params)
    del plain
    spec = LLM(model, spec="ngram", draft_tokens=3, **SETTINGS)
    assert spec.engine.runner.verify_graphs is not None
    tok = spec.get_tokenizer()
    spec.engine.proposer = ReplayProposer({tuple(tok.encode(p)): out for p, out in zip(PROMPTS, expected)})
    assert _run(spec, PROMPTS, params) == expected
    stats = spec.engine.stats
    assert 0 < stats.total_accepted < stats.total_drafted


@gpu
@needs_cuda
@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5", "qwen3_5_moe"])
def test_mtp_speculation_on_cuda_is_lossless(family):
    torch.backends.cuda.matmul.allow_tf32 = False
    model = f"tiny:{family}"
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    expected = _run(LLM(model, **SETTINGS), PROMPTS, params)
    spec = LLM(model, spec="mtp", draft_tokens=3, **SETTINGS)
    assert _run(spec, PROMPTS, params) == expected
    assert spec.engine.stats.total_drafted > 0


@gpu
@needs_cuda
@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
def test_guided_rows_speculate_through_graph_verify_steps(family):
    """Guided verify rows on CUDA: the graph computes the hidden rows, the guide's masks
    (filled on the host into pinned memory) apply to the verdict outside it."""
    from test_spec_guided import check_greedy_guided

    torch.backends.cuda.matmul.allow_tf32 = False
    model = f"tiny:{family}"
    settings = {**SETTINGS, "max_concurrency": 6}
    spec = LLM(model, spec="ngram", draft_tokens=3, **settings)
    assert spec.engine.runner.verify_graphs is not None
    replayed = []
    run_graph = spec.engine.runner.verify_graphs.run
    spec.engine.runner.verify_graphs.run = lambda *a, **k: replayed.append(1) or run_graph(*a, **k)
    check_greedy_guided(family, LLM(model, **settings), spec)
    assert replayed
