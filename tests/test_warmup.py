"""The startup warm-up (run on CUDA) leaves no trace in the engine."""

from __future__ import annotations

import os

from ninfer import LLM, SamplingParams
from ninfer.engine.warmup import warm_up


def test_warm_up_leaves_no_trace(one_thread):
    params = [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)]
    cold = LLM("tiny:qwen3", device="cpu", dtype="fp32", max_concurrency=4, max_context=128, kv_capacity=1024)
    want = cold.generate(["Hello there"], params)[0].outputs[0].token_ids

    llm = LLM("tiny:qwen3", device="cpu", dtype="fp32", max_concurrency=4, max_context=128, kv_capacity=1024)
    engine = llm.engine
    assert warm_up(engine) > 0
    assert not engine.has_unfinished()
    assert engine.block_manager.num_used_blocks == 0
    assert len(engine.block_manager.cache) == 0  # nothing published for reuse
    assert engine.stats.steps == 0 and engine.stats.finished == 0
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
