"""The engine thread + asyncio streaming API used by the HTTP layer."""

from __future__ import annotations

import asyncio
import re

import pytest
from loguru import logger

from ninfer import LLM, SamplingParams
from ninfer.engine.async_engine import AsyncEngine
from ninfer.engine.output_processor import RequestOutputState
from ninfer.engine.request import EngineRequest
from ninfer.errors import InvalidRequestError


@pytest.fixture(scope="module")
def llm(tiny_qwen3):
    return LLM(str(tiny_qwen3), dtype="fp32", device="cpu", max_concurrency=4, prefill_chunk=8, block_size=4,
               max_context=256, kv_capacity=1024)


async def _collect(engine: AsyncEngine, req: EngineRequest):
    text, ids, last = "", [], None
    async for event in engine.generate(req):
        text += event.text
        ids += event.token_ids
        last = event
    return text, ids, last


def test_stream_equals_offline_and_cancel_frees_pages(llm):
    tok = llm.get_tokenizer()
    ids = tok.encode("Streaming through the async engine")
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    offline = llm.generate({"prompt_token_ids": ids}, greedy)[0].outputs[0]
    engine = AsyncEngine(llm.engine, stats_interval_s=0)
    engine.start()
    try:

        async def main():
            streams = await asyncio.gather(
                *[_collect(engine, EngineRequest(f"s{i}", ids, greedy)) for i in range(3)]
            )
            for text, token_ids, last in streams:
                assert token_ids == offline.token_ids and text == offline.text
                assert last.finished and last.finish_reason == "length"

            # A consumer that stops early aborts its request and frees its pages.
            agen = engine.generate(EngineRequest("cancel-me", ids, SamplingParams(max_tokens=200, ignore_eos=True)))
            await agen.__anext__()
            await agen.aclose()
            for _ in range(100):
                if llm.engine.block_manager.num_used_blocks == 0 and not llm.engine.has_unfinished():
                    break
                await asyncio.sleep(0.02)
            assert llm.engine.block_manager.num_used_blocks == 0

            with pytest.raises(InvalidRequestError):
                await _collect(engine, EngineRequest("bad", ids, SamplingParams(top_k=-1)))

        asyncio.run(main())
    finally:
        engine.shutdown()


def test_one_failing_request_does_not_disturb_others(llm, monkeypatch):
    original = RequestOutputState.on_token

    def flaky(self, token_id):
        if getattr(self, "_poisoned", False):
            raise RuntimeError("boom")
        return original(self, token_id)

    monkeypatch.setattr(RequestOutputState, "on_token", flaky)
    engine = llm.engine
    tok = llm.get_tokenizer()
    engine.add_request(EngineRequest("good", tok.encode("fine"), SamplingParams(max_tokens=5, ignore_eos=True)))
    engine.add_request(EngineRequest("bad", tok.encode("broken"), SamplingParams(max_tokens=5, ignore_eos=True)))
    engine._requests["bad"].out._poisoned = True
    finals = {}
    while engine.has_unfinished():
        for ev in engine.step():
            if ev.finished:
                finals[ev.request_id] = ev
    assert finals["bad"].finish_reason == "error" and finals["bad"].error is not None
    assert finals["good"].finish_reason == "length" and finals["good"].num_output_tokens == 5
    assert engine.block_manager.num_used_blocks == 0


def test_throughput_line_averages_decode_steps_and_counts_prefix_hits_per_interval(llm):
    engine = AsyncEngine(llm.engine, stats_interval_s=0)  # not started: this thread steps the engine
    tok = llm.get_tokenizer()
    lines: list[str] = []
    sink = logger.add(lambda m: lines.append(m.record["message"]), level="INFO", format="{message}")

    def run(name: str, text: str) -> None:
        ids = tok.encode(text)
        assert len(ids) > 2 * 8  # several prefill-only steps at prefill_chunk 8
        llm.engine.add_request(EngineRequest(name, ids, SamplingParams(max_tokens=4, ignore_eos=True)))
        while llm.engine.has_unfinished():
            llm.engine.step()

    try:
        llm.engine.stats.take_interval()  # what earlier tests left behind; the cache counters' baseline
        # is the one AsyncEngine took when it was constructed, just above
        prompt = "zebra quartz lantern " * 6
        run("cold", prompt)  # one sequence at a time: prefill steps, then decode steps of one
        run("warm", prompt)  # the same prompt again: its full pages come from the prefix cache
        engine._log_stats()
        run("other", "violet mango harbor " * 6)  # nothing cached for it
        engine._log_stats()
    finally:
        logger.remove(sink)
    first, second = [line for line in lines if line.startswith("throughput:")]
    assert "avg batch 1.0," in first and "avg batch 1.0," in second, (first, second)
    hit = int(re.search(r"prefix hit (\d+)%", first).group(1))
    assert 0 < hit < 100, first
    assert second.endswith("prefix hit 0%"), second  # this interval's lookups only


def test_throughput_line_reports_composition_and_host_time_and_leaves_out_zeros():
    from types import SimpleNamespace

    from ninfer.engine.async_engine import throughput_line
    from ninfer.engine.exposure import HostWork
    from ninfer.engine.stats import ContextCacheCounters, IntervalStats

    counters = ContextCacheCounters(*[0] * 12)
    sched = SimpleNamespace(num_running=3, num_prefilling=1, num_decode_ready=2, num_waiting=0)
    work = HostWork(submit=1.5, commit=0.4, requests=0.05, publish=0.05)  # 2.0 s of 5.0
    # an interval that only prefilled: no decode rate, no batch, an empty queue
    s = IntervalStats(seconds=5.0, prefill_tokens=1800, decode_tokens=0, steps=4, decode_steps=0, decode_rows=0,
                      busy_seconds=2.0, finished=0, host_work=work)
    line = throughput_line(s, sched, 0.21, counters, counters)
    assert line == ("throughput: prefill 1800 tokens (360.0 tok/s), running 3 (1 prefilling, 2 decode-ready), "
                    "host active 2.00 s (40% of 5.0 s), KV 21% used"), line
    s = IntervalStats(seconds=5.0, prefill_tokens=0, decode_tokens=120, steps=60, decode_steps=60, decode_rows=120,
                      busy_seconds=2.0, finished=2, host_work=work)
    sched.num_waiting = 4
    line = throughput_line(s, sched, 0.5, counters, counters)
    assert line.startswith("throughput: decode 120 tokens (24.0 tok/s), finished 2, running 3 (1 prefilling, "
                           "2 decode-ready), waiting 4, avg batch 2.0, host active 2.00 s (40%"), line
