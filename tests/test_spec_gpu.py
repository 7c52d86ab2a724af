"""Speculative rounds on CUDA: verify steps replayed from graphs give the eager tokens."""

from __future__ import annotations

import pytest
import torch

from ninfer import LLM, SamplingParams

from test_spec_decode import PROMPTS, ReplayProposer, _run
from test_spec_device_rounds import trained  # noqa: F401 (a fixture)

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


@gpu
@needs_cuda
@pytest.mark.parametrize("reuse,block", [(False, 16), (True, 4)], ids=["no-reuse", "reuse-pages-of-4"])
def test_captured_device_rounds_equal_plain_greedy_and_the_host_rounds(trained, monkeypatch, reuse, block):
    """Greedy MTP rounds replayed whole from CUDA graphs, launched ahead of their verdicts
    (with two scratch banks when prefix reuse takes snapshots), against plain decoding and
    against the same rounds driven from the host."""
    from test_spec_device_rounds import GREEDY, PROMPTS as ROUND_PROMPTS

    torch.backends.cuda.matmul.allow_tf32 = False
    settings = {**SETTINGS, "max_context": 256, "prefix_reuse": reuse, "block_size": block}
    params = SamplingParams(max_tokens=40, ignore_eos=True, **GREEDY)
    expected = _run(LLM(trained, **settings), ROUND_PROMPTS, params)
    monkeypatch.setenv("NINFER_DEVICE_ROUNDS", "0")
    host = LLM(trained, spec="mtp", draft_tokens=3, **settings)
    monkeypatch.delenv("NINFER_DEVICE_ROUNDS")
    device = LLM(trained, spec="mtp", draft_tokens=3, **settings)
    rounds = device.engine.runner.rounds
    assert host.engine.runner.rounds is None and rounds is not None and rounds._graphs
    assert rounds.banked == reuse
    assert _run(host, ROUND_PROMPTS, params) == expected
    assert _run(device, ROUND_PROMPTS, params) == expected
    h, d = host.engine.stats, device.engine.stats
    assert (d.total_rounds, d.total_drafted, d.total_accepted) == (h.total_rounds, h.total_drafted, h.total_accepted)
    assert d.total_accepted > 0 and d.total_steps_ahead > 5
