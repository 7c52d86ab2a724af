"""Timed runs of our engine."""

from __future__ import annotations

import time
from contextlib import contextmanager, nullcontext

from ninfer.bench.workload import Workload
from ninfer.engine.request import EngineRequest
from ninfer.sampling_params import SamplingParams


#: plain greedy: no family preset may add a penalty (Qwen3.5's add a presence penalty),
#: so every engine and baseline decodes the same argmax chain
GREEDY = dict(temperature=0.0, presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0)


def _submit(engine, work: Workload, tag: str, synthetic: bool = False, presets: bool = False) -> None:
    """``presets``: sample as a request that names no sampler settings would (the family's
    presets: Qwen3.5's top-k, top-p and presence penalty), each request with its own seed."""
    for i, (ids, n) in enumerate(zip(work.prompts, work.output_lens)):
        params = SamplingParams(max_tokens=n, ignore_eos=True, seed=i) if presets else \
            SamplingParams(max_tokens=n, ignore_eos=True, **GREEDY)
        # a synthetic context's pages hold no real prompt: nobody may reuse them
        engine.add_request(EngineRequest(f"{tag}{i}", ids, params, lookup_prefix_cache=not synthetic,
                                         commit_prefix_cache=not synthetic))


@contextmanager
def synthetic_contexts(engine):
    """While open, each admitted sequence counts every prompt token but the last as
    computed without running them: its pages are allocated for the whole prompt but hold
    whatever the pool held (recurrent state likewise). Decode then attends over the full
    context, as it would after a real prefill, without the minutes a 128k prefill takes
    (8 x 128k is about four minutes of prefill on the 27B shape). Speed only: the tokens
    it produces mean nothing."""
    blocks = engine.scheduler.block_manager
    allocate = blocks.allocate

    def allocate_as_prefilled(seq) -> None:
        allocate(seq)
        seq.num_computed_tokens = max(seq.num_computed_tokens, seq.num_prompt_tokens - 1)

    blocks.allocate = allocate_as_prefilled
    try:
        yield
    finally:
        del blocks.allocate  # the class's method again


def offline_throughput(engine, work: Workload) -> dict:
    """All requests at once (the scheduler admits what fits); output tokens per second."""
    _submit(engine, work, "off")
    start = time.perf_counter()
    produced = 0
    while engine.has_unfinished():
        produced += sum(len(e.token_ids) for e in engine.step())
    seconds = time.perf_counter() - start
    return {"output_tokens": produced, "seconds": seconds, "output_tok_s": produced / seconds}


def decode_throughput(engine, work: Workload, synthetic: bool = False, presets: bool = False) -> dict:
    """Steady decode rate at the workload's concurrency: the clock runs from the step after
    every request has its first token to the first request's end. Long prompts prefill one
    chunk at a time, so the first requests decode alongside the later ones' prefill and may
    finish before the batch is ever whole: then ``full_batch`` is false and the rate counts
    every step after the last first token (fewer rows than asked). Otherwise steps past the
    first finish do not count: requests leaving one by one would lower the batch.
    ``synthetic``: the prompts' contexts come without a prefill (:func:`synthetic_contexts`);
    ``presets``: the family's sampler presets rather than plain greedy (see :func:`_submit`)."""
    with synthetic_contexts(engine) if synthetic else nullcontext():
        return _decode_throughput(engine, work, synthetic, presets)


def _decode_throughput(engine, work: Workload, synthetic: bool, presets: bool) -> dict:
    _submit(engine, work, "dec", synthetic, presets)
    started: set[str] = set()
    ended_early = False
    while len(started) < len(work.prompts) and engine.has_unfinished():
        for e in engine.step():
            started.update([e.request_id] if e.token_ids else [])
            ended_early |= e.finished
    begin, tokens, steps = time.perf_counter(), 0, 0
    work_before = engine.stats.host_work_so_far()
    while engine.has_unfinished():
        events = engine.step()
        tokens += sum(len(e.token_ids) for e in events)
        steps += 1
        if any(e.finished for e in events) and not ended_early:
            break
    seconds = time.perf_counter() - begin
    split = host_split(work_before, engine.stats.host_work_so_far())
    while engine.has_unfinished():  # the rest, untimed
        engine.step()
    return {
        "decode_tokens": tokens,
        "seconds": seconds,
        "decode_tok_s": tokens / seconds if seconds else 0.0,
        "step_ms": 1000 * seconds / steps if steps else 0.0,
        "steps": steps,
        "full_batch": not ended_early,
        **split,
    }


def host_split(before, after) -> dict:
    """The engine thread's time per decode step between two :class:`HostWork` copies: its own
    work (scheduling, launching, committing) and its wait for the device. A wait near zero
    means the host set the pace: the device idled between steps. ``host_steps``: the decode
    steps the engine counted, which should equal the caller's own step count (a check)."""
    steps = after.decode_steps - before.decode_steps
    if steps <= 0:
        return {}
    return {"host_ms": round(1000 * (after.decode_host - before.decode_host) / steps, 4),
            "device_wait_ms": round(1000 * (after.decode_device_wait - before.decode_device_wait) / steps, 4),
            "host_steps": steps}
