"""Timed runs of our engine."""

from __future__ import annotations

import time

from ninfer.bench.workload import Workload
from ninfer.engine.request import EngineRequest
from ninfer.sampling_params import SamplingParams


#: plain greedy: no family preset may add a penalty (Qwen3.5's add a presence penalty),
#: so every engine and baseline decodes the same argmax chain
GREEDY = dict(temperature=0.0, presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0)


def _submit(engine, work: Workload, tag: str) -> None:
    for i, (ids, n) in enumerate(zip(work.prompts, work.output_lens)):
        params = SamplingParams(max_tokens=n, ignore_eos=True, **GREEDY)
        engine.add_request(EngineRequest(f"{tag}{i}", ids, params))


def offline_throughput(engine, work: Workload) -> dict:
    """All requests at once (the scheduler admits what fits); output tokens per second."""
    _submit(engine, work, "off")
    start = time.perf_counter()
    produced = 0
    while engine.has_unfinished():
        produced += sum(len(e.token_ids) for e in engine.step())
    seconds = time.perf_counter() - start
    return {"output_tokens": produced, "seconds": seconds, "output_tok_s": produced / seconds}


def decode_throughput(engine, work: Workload) -> dict:
    """Steady decode rate: the clock starts once every request has its first token."""
    _submit(engine, work, "dec")
    started: set[str] = set()
    while len(started) < len(work.prompts) and engine.has_unfinished():
        started.update(e.request_id for e in engine.step() if e.token_ids)
    begin, tokens, steps = time.perf_counter(), 0, 0
    while engine.has_unfinished():
        tokens += sum(len(e.token_ids) for e in engine.step())
        steps += 1
    seconds = time.perf_counter() - begin
    return {
        "decode_tokens": tokens,
        "seconds": seconds,
        "decode_tok_s": tokens / seconds if seconds else 0.0,
        "step_ms": 1000 * seconds / steps if steps else 0.0,
    }
