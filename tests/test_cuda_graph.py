"""Decode from CUDA graphs equals eager decode, and padding rows never touch the KV cache."""

from __future__ import annotations

import re

import pytest
import torch

from ninfer import LLM, SamplingParams
from ninfer.engine.cuda_graph import DecodeGraphs, buckets_up_to

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

PROMPTS = ["Hello", "The quick brown fox", "def f(x):\n    return", "1 2 3 4 5", "Paged", "a b", "xyz"]


def test_buckets_cover_every_batch_size_up_to_the_limit():
    assert buckets_up_to(1) == [1]
    assert buckets_up_to(8) == [1, 2, 4, 8]
    assert buckets_up_to(20) == [1, 2, 4, 8, 16, 20]
    sizes = buckets_up_to(64)
    assert sizes[-1] == 64 and sizes == sorted(set(sizes))


def test_one_transfer_stages_every_row_field_and_padding():
    """What a replay reads, staged on the CPU (capture needs CUDA; staging does not)."""
    graphs = DecodeGraphs(None, max_batch=8, max_context=64, block_size=4, device=torch.device("cpu"))
    bucket = graphs.stage_inputs([5, 6, 7], [0, 5, 9], [[1], [2, 3], [4, 5, 6]])
    assert bucket == 4
    assert graphs.input_ids[:4].tolist() == [5, 6, 7, 0]
    assert graphs.positions[:4].tolist() == [0, 5, 9, 0]
    assert graphs.seq_lens[:4].tolist() == [1, 6, 10, 1]  # padding rows attend to one key
    assert graphs.slot_mapping[:4].tolist() == [4, 13, 25, -1]  # padding rows write no KV
    assert graphs.block_tables[:4, :3].tolist() == [[1, 0, 0], [2, 3, 0], [4, 5, 6], [0, 0, 0]]
    first_host = graphs._inputs._hosts[0].clone()

    # a smaller batch, ids already on the device: the rows it leaves become padding
    assert graphs.stage_inputs(torch.tensor([8]), [2], [[7]]) == 1
    assert graphs.input_ids[:1].tolist() == [8]
    assert graphs.positions[:4].tolist() == [2, 0, 0, 0]
    assert graphs.seq_lens[:4].tolist() == [3, 1, 1, 1]
    assert graphs.slot_mapping[:4].tolist() == [30, -1, -1, -1]
    # it was packed in the other pinned buffer: the first one's transfer may still be queued
    assert torch.equal(graphs._inputs._hosts[0], first_host)


def test_state_slots_are_staged_with_the_rows_and_padding_gets_none():
    graphs = DecodeGraphs(None, max_batch=8, max_context=64, block_size=4, device=torch.device("cpu"),
                          state_slots=True)
    assert graphs.stage_inputs([5, 6, 7], [0, 5, 9], [[1], [2, 3], [4, 5, 6]], state_slots=[3, 0, 7]) == 4
    assert graphs.state_slots[:4].tolist() == [3, 0, 7, -1]  # padding rows keep no recurrent state
    assert graphs.slot_mapping[:4].tolist() == [4, 13, 25, -1]
    assert graphs.block_tables[:3, :3].tolist() == [[1, 0, 0], [2, 3, 0], [4, 5, 6]]
    assert graphs._batch(4).state_slots.tolist() == [3, 0, 7, -1]
    assert graphs.stage_inputs([8], [2], [[7]], state_slots=[5]) == 1
    assert graphs.state_slots[:4].tolist() == [5, -1, -1, -1]
    with pytest.raises(ValueError, match="state slots"):
        graphs.stage_inputs([8], [2], [[7]])  # captured with slots: every step must give them


def test_the_captured_argmax_serves_only_rows_that_take_the_raw_argmax():
    from ninfer.engine.spec.verify_step import raw_argmax_rows
    from test_spec_acceptance import row

    greedy = row(temperature=0.0)
    assert raw_argmax_rows([greedy, greedy], [0, 5])
    assert not raw_argmax_rows([greedy, row(temperature=0.7)], [0, 0])  # a sampled row
    assert not raw_argmax_rows([row(temperature=0.0, logprobs=2)], [0])  # log probabilities
    assert not raw_argmax_rows([row(temperature=0.0, presence_penalty=0.5)], [0])
    assert not raw_argmax_rows([row(temperature=0.0, logit_bias={3: 1.0})], [0])
    banned = row(temperature=0.0, stop_token_ids=(2,), min_tokens=3)
    assert not raw_argmax_rows([banned], [2]) and raw_argmax_rows([banned], [3])  # the stop ban has ended


FAMILIES = ["qwen3", "qwen3_moe", "qwen3_next", "qwen3_5", "qwen3_5_moe"]


def _generate(cuda_graph: bool, ahead: bool = True, family: str = "qwen3") -> tuple[list[list[int]], LLM]:
    llm = LLM(f"tiny:{family}", device="cuda", dtype="fp32", max_concurrency=8, prefill_chunk=16,
              max_context=256, kv_capacity=4096, cuda_graph=cuda_graph, decode_ahead=ahead)
    # different lengths, so the batch shrinks through several buckets as requests finish
    params = [SamplingParams(temperature=0, max_tokens=8 + 5 * i, ignore_eos=True) for i in range(len(PROMPTS))]
    outs = llm.generate(PROMPTS, params)
    return [o.outputs[0].token_ids for o in outs], llm


@gpu
@needs_cuda
@pytest.mark.parametrize("family", FAMILIES)
def test_graph_decode_equals_eager_decode(family):
    """Every family's whole decode step (recurrent layers with their state slots, MoE
    routing and experts) replays from graphs and gives the eager tokens."""
    torch.backends.cuda.matmul.allow_tf32 = False
    eager, llm_eager = _generate(False, ahead=False, family=family)
    graphed, llm_graph = _generate(True, family=family)
    assert llm_eager.engine.runner.graphs is None
    assert llm_graph.engine.runner.graphs is not None
    assert graphed == eager
    assert _generate(True, ahead=False, family=family)[0] == eager


@gpu
@needs_cuda
@pytest.mark.parametrize("family", FAMILIES)
def test_guided_rows_in_graph_batches_equal_eager(family):
    """Guided rows (their masks applied after the replayed forward) mixed with plain and
    seeded sampled rows: the graph path with steps queued ahead gives the eager tokens."""
    from ninfer.guided.spec import GuideSpec

    torch.backends.cuda.matmul.allow_tf32 = False
    guide = GuideSpec("regex", r"[a-z]+( [a-z]+){2,5}\.")
    params = [SamplingParams(temperature=0, max_tokens=24, guided=guide),
              SamplingParams(temperature=0.8, seed=3, max_tokens=20, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
              SamplingParams(temperature=0.7, seed=5, max_tokens=24, guided=guide)]
    runs = []
    for cuda_graph in (False, True):
        llm = LLM(f"tiny:{family}", device="cuda", dtype="fp32", max_concurrency=8, prefill_chunk=16,
                  max_context=256, kv_capacity=4096, cuda_graph=cuda_graph, decode_ahead=cuda_graph)
        outs = llm.generate(PROMPTS[:4], params)
        runs.append([o.outputs[0].token_ids for o in outs])
        if cuda_graph:
            assert llm.engine.runner.graphs is not None
            text = llm.get_tokenizer().decode(runs[-1][0])
            assert re.fullmatch(r"[a-z]+( [a-z]*)*\.?", text), text  # the pattern, or a prefix of it at max_tokens
    assert runs[0] == runs[1]


@gpu
@needs_cuda
def test_small_buckets_capture_the_lm_head(monkeypatch):
    """Buckets up to HEAD_ROWS replay the LM head and its argmax with the forward, equal to
    the head run on the replayed hidden rows; larger buckets leave it out. (The engine's
    eight requests at most all fit the default of 16, so the test lowers it to 2.)"""
    from ninfer.engine import cuda_graph

    monkeypatch.setattr(cuda_graph, "HEAD_ROWS", 2)
    torch.backends.cuda.matmul.allow_tf32 = False
    llm = LLM("tiny:qwen3_5_moe", device="cuda", dtype="fp32", max_concurrency=8, max_context=128, kv_capacity=4096)
    graphs, model = llm.engine.runner.graphs, llm.engine.model
    assert graphs is not None and graphs.buckets == [1, 2, 4, 8]
    for rows in (1, 2):
        hidden = graphs.run(list(range(5, 5 + rows)), [0] * rows, [[i + 1] for i in range(rows)],
                            state_slots=list(range(rows)))
        head = graphs.last_head(rows)
        logits = model.compute_logits(hidden)
        assert head is not None and torch.allclose(head.logits, logits, rtol=0, atol=1e-5)
        assert torch.equal(head.greedy_ids, head.logits.argmax(dim=-1))
    graphs.run(list(range(5)), [0] * 5, [[i + 1] for i in range(5)], state_slots=list(range(5)))
    assert graphs.last_head(5) is None and not graphs.has_head(8)  # bucket 8
    # a batch shrinking from bucket 8 (the eager head) to 2 and 1 (the captured one): eager tokens
    params = [SamplingParams(temperature=0, max_tokens=3 + 3 * i, ignore_eos=True) for i in range(5)]
    eager = LLM("tiny:qwen3_5_moe", device="cuda", dtype="fp32", max_concurrency=8, max_context=128,
                kv_capacity=4096, cuda_graph=False)
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:5], params)] == \
        [o.outputs[0].token_ids for o in eager.generate(PROMPTS[:5], params)]


@gpu
@needs_cuda
def test_hybrid_padding_rows_leave_the_recurrent_state_untouched():
    llm = LLM("tiny:qwen3_5", device="cuda", dtype="fp32", max_concurrency=8, max_context=128, kv_capacity=2048)
    graphs = llm.engine.runner.graphs
    assert graphs is not None and graphs.state_slots is not None
    states = llm.engine.model.state_tensors()
    before = [t.clone() for t in states]
    graphs.run([5, 6, 7], [0, 0, 0], [[1], [2], [3]], state_slots=[1, 2, 3])  # bucket 4: row four pads
    torch.cuda.synchronize()
    for b, t in zip(before, states):
        changed = (b != t).flatten(1).any(dim=1).nonzero().flatten().tolist()
        assert set(changed) == {1, 2, 3}  # only the three sequences' slots moved


@gpu
@needs_cuda
def test_padding_rows_leave_the_kv_cache_untouched():
    llm = LLM("tiny:qwen3", device="cuda", dtype="fp32", max_concurrency=8, max_context=128, kv_capacity=2048)
    graphs = llm.engine.runner.graphs
    assert graphs is not None
    caches = [layer.self_attn.kv_cache for layer in llm.engine.model.model.layers]
    before = [torch.cat([c.k, c.v]).clone() for c in caches]
    # three sequences replayed in the bucket of four: row four is padding
    tables = [[1], [2], [3]]
    graphs.run([5, 6, 7], [0, 0, 0], tables)
    torch.cuda.synchronize()
    for b, c in zip(before, caches):
        a = torch.cat([c.k, c.v])
        blocks = c.k.shape[0]
        changed = sorted({i % blocks for i in (b != a).flatten(1).any(dim=1).nonzero().flatten().tolist()})
        assert changed == [1, 2, 3]  # only the three sequences' pages were written


@gpu
@needs_cuda
def test_graphs_survive_cublas_workspaces_being_freed():
    """torch.compile's graph trees clear cuBLAS's workspaces; our graphs must not have
    captured that shared memory (once freed and released, replay would fault)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    eager, _ = _generate(False)
    llm = LLM("tiny:qwen3", device="cuda", dtype="fp32", max_concurrency=8, prefill_chunk=16,
              max_context=256, kv_capacity=4096)
    torch._C._cuda_clearCublasWorkspaces()
    torch.cuda.empty_cache()
    params = [SamplingParams(temperature=0, max_tokens=8 + 5 * i, ignore_eos=True) for i in range(len(PROMPTS))]
    outs = llm.generate(PROMPTS, params)
    torch.cuda.synchronize()
    assert [o.outputs[0].token_ids for o in outs] == eager
