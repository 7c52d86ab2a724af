"""The startup warm-up (run on CUDA) leaves no trace in the engine."""

from __future__ import annotations

import os

import pytest

from ninfer import LLM, SamplingParams
from ninfer.engine.warmup import warm_up


def test_warm_up_leaves_no_trace(one_thread):
    params = [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)]
    cold = LLM("tiny:qwen3", device="cpu", dtype="fp32", max_concurrency=4, max_context=128, kv_capacity=1024)
    want = cold.generate(["Hello there"], params)[0].outputs[0].token_ids

    llm = LLM("tiny:qwen3", device="cpu", dtype="fp32", max_concurrency=4, max_context=128, kv_capacity=1024)
    engine = llm.engine
    chunking = engine.scheduler.prefill_chunk, engine.scheduler.max_batched_tokens
    assert warm_up(engine) > 0
    assert not engine.has_unfinished()
    assert engine.block_manager.num_used_blocks == 0
    assert len(engine.block_manager.cache) == 0  # nothing published for reuse
    assert engine.stats.steps == 0 and engine.stats.finished == 0
    assert (engine.scheduler.prefill_chunk, engine.scheduler.max_batched_tokens) == chunking  # restored
    assert llm.generate(["Hello there"], params)[0].outputs[0].token_ids == want


def test_autotuning_results_are_kept_unless_the_user_chose(monkeypatch):
    """Triton's autotuners (flash-linear-attention's) keep their choices on disk, so a
    restarted server does not time every candidate again; a user's setting stands."""
    from ninfer.engine.warmup import keep_autotuning_results

    monkeypatch.delenv("TRITON_CACHE_AUTOTUNING", raising=False)
    keep_autotuning_results()
    assert os.environ["TRITON_CACHE_AUTOTUNING"] == "1"
    monkeypatch.setenv("TRITON_CACHE_AUTOTUNING", "0")
    keep_autotuning_results()
    assert os.environ["TRITON_CACHE_AUTOTUNING"] == "0"


def test_warm_up_rounds_reach_the_prefill_chunk():
    """Long prompts double from 64 tokens to the chunk, each a token short of a power of two
    and at it (both of Triton's integer specialisations in every table bucket), then a
    whole chunk beside a short prompt: the largest step serving will run."""
    from ninfer.engine.warmup import PROMPT_LENGTHS, warm_up_rounds

    rounds = warm_up_rounds(chunk=1024, max_concurrency=4, limit=8000, pool=20000, out=3)
    alone = [r[0] for r in rounds if len(r) == 1]
    assert alone == [*PROMPT_LENGTHS, 63, 64, 127, 128, 255, 256, 511, 512, 1023, 1024]
    assert rounds[-2] == list(PROMPT_LENGTHS[:4]) and rounds[-1] == [1024, 2]
    # a chunk that is no power of two is warmed at its own size too
    alone = [r[0] for r in warm_up_rounds(chunk=3000, max_concurrency=1, limit=8000, pool=20000, out=3)
             if len(r) == 1]
    assert alone[-4:] == [2047, 2048, 2999, 3000]


def test_warm_up_rounds_stay_inside_the_context_and_pool():
    rounds = warm_up_rounds_of(chunk=8192, limit=300, pool=305)
    assert max(max(r) for r in rounds) == 300
    assert [300, 2] not in rounds  # 300 + 2 prompts' tokens and outputs exceed the pool
    assert warm_up_rounds_of(chunk=8192, limit=300, pool=400)[-1] == [300, 2]
    # one request at a time: no round runs two prompts together
    assert all(len(r) == 1 for r in warm_up_rounds_of(chunk=256, limit=1000, pool=2000, max_concurrency=1))


def warm_up_rounds_of(chunk, limit, pool, max_concurrency=2):
    from ninfer.engine.warmup import warm_up_rounds

    return warm_up_rounds(chunk, max_concurrency, limit, pool, out=3)


def test_continued_round_spans_three_chunks():
    """Later chunks of a prompt continue its sequence: the engine's own chunk when the
    context holds two of them, else a third of the longest prompt."""
    from ninfer.engine.warmup import continued_round

    assert continued_round(chunk=1024, limit=8189) == (2049, 1024)
    assert continued_round(chunk=4096, limit=8189) == (5459, 2729)
    assert continued_round(chunk=8192, limit=125) == (83, 41)


def test_set_prefill_chunk_keeps_the_decode_rows_room(one_thread):
    """The step budget moves with the chunk (the warm-up's continued prompt and the chunk
    benchmark change it on a loaded engine), so decode rows and drafts keep their share."""
    from ninfer.engine.scheduler import step_token_budget

    sched = LLM("tiny:qwen3", device="cpu", dtype="fp32", max_concurrency=4, prefill_chunk=1024).engine.scheduler
    assert sched.max_batched_tokens == step_token_budget(1024, 4)
    sched.set_prefill_chunk(64)
    assert (sched.prefill_chunk, sched.max_batched_tokens) == (64, step_token_budget(64, 4))
    with pytest.raises(ValueError):
        sched.set_prefill_chunk(0)


def test_a_speculating_engine_warms_up_verify_rows_beside_prefill_chunks(one_thread, monkeypatch):
    """Such a step has no graph, so its kernels (the verify rows' variants) must compile
    in the warm-up: full-width verify rows beside a prefill chunk, with block tables 3, 16
    and 1 pages wide. Nothing of it stays behind."""
    llm = LLM("tiny:qwen3_5", device="cpu", dtype="fp32", max_concurrency=4, max_context=512, kv_capacity=4096,
              spec="mtp", draft_tokens=3)
    engine, seen = llm.engine, []
    schedule = engine.scheduler.schedule

    def recorded(drafts=None):
        out = schedule(drafts)
        if out.num_verify and out.num_prefill:
            seen.append((1 + max(len(c.drafts) for c in out.chunks[: out.num_verify]),
                         max(len(c.seq.block_table) for c in out.chunks)))
        return out

    monkeypatch.setattr(engine.scheduler, "schedule", recorded)
    warm_up(engine)
    assert {(4, 3), (4, 16), (4, 1)} <= set(seen)
    assert not engine.has_unfinished() and engine.block_manager.num_used_blocks == 0
    assert engine.stats.steps == 0


def test_a_hybrid_engine_warms_up_its_state_snapshot_copy(one_thread, monkeypatch):
    """The throwaway requests take no snapshots, so the warm-up runs the snapshot row copy
    itself (its kernel compiled before a served prompt needs it): a row onto itself, which
    leaves every state pool as it was."""
    from ninfer.engine import state_cache

    llm = LLM("tiny:qwen3_5", device="cpu", dtype="fp32", max_concurrency=4, max_context=256, kv_capacity=2048)
    engine = llm.engine
    copies = []
    real = state_cache.ops.copy_state_rows
    monkeypatch.setattr(state_cache.ops, "copy_state_rows",
                        lambda pools, src, dst: copies.append((src.tolist(), dst.tolist())) or real(pools, src, dst))
    pools = [t.clone() for t in engine.model.state_tensors()]
    warm_up(engine)
    assert len(copies) == 1 and copies[0][0] == copies[0][1]
    assert engine.scheduler.snapshots.stats.captures == 0
    snap_row = copies[0][0][0]
    assert all((t[snap_row] == p[snap_row]).all() for t, p in zip(engine.model.state_tensors(), pools))


def test_warm_up_says_it_began_and_how_far_it_got(one_thread, monkeypatch):
    """A first start compiles for a minute or more: the warm-up says it began, then at
    intervals (here every round) how many of its rounds are done, before its summary."""
    from loguru import logger

    from ninfer.engine import warmup

    monkeypatch.setattr(warmup, "PROGRESS_S", 0.0)
    lines: list[str] = []
    sink = logger.add(lambda m: lines.append(m.record["message"]), level="INFO")
    try:
        llm = LLM("tiny:qwen3", device="cpu", dtype="fp32", max_concurrency=4, max_context=128, kv_capacity=1024)
        lines.clear()
        warm_up(llm.engine)
    finally:
        logger.remove(sink)
    first, *middle, last = [m for m in lines if "warm" in m]
    assert first.startswith("warming up kernels: ") and first.endswith("rounds of throwaway requests before serving")
    total = int(first.split(": ")[1].split()[0])
    assert [m.split(" of ")[0] for m in middle] == [f"warm-up: {i}" for i in range(1, total)]
    assert last.startswith("warmed up kernels with ")
