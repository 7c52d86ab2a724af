"""The per-token cost of guided decoding: one decode workload with and without a guide.

Each guide below stays open for the whole output: a logit bias of -100 keeps the model
off end-of-sequence and off the tokens that would close the guide (``]`` of the JSON
array, ``}`` of the object), so every request decodes exactly the requested length and
guided steps compare with plain ones at the same batch size. Both runs sample at
temperature 1 with the same seeds. The mask fill (host) is timed on its own (the engine
keeps each fill's time, ``GuidedMasks.take_fill_seconds``); the rest of the difference
is moving and applying the masks. Plain and guided runs alternate for a few rounds; a
run's time is its median step and a figure keeps its fastest round, so bursts of other
work on a shared machine do not decide it.
"""

from __future__ import annotations

import statistics
import time
from typing import Iterator, Optional

from ninfer.bench.workload import Workload, fixed_workload
from ninfer.engine.request import EngineRequest
from ninfer.guided.spec import GuideSpec
from ninfer.sampling_params import SamplingParams

#: guide -> (spec, bytes whose tokens would close it)
GUIDES: dict[str, tuple[GuideSpec, bytes]] = {
    "json_schema": (GuideSpec("json_schema", {
        "type": "object", "properties": {"notes": {"type": "array", "items": {"type": "string"}}},
        "required": ["notes"]}), b"]"),
    "json_object": (GuideSpec("json_object"), b"}"),
    "regex": (GuideSpec("regex", r"[a-z][a-z ,.]*"), b""),
    "ebnf": (GuideSpec("ebnf", 'root ::= word (" " word)*\nword ::= [a-z]+'), b""),
}


def _closing_bias(tokenizer, closers: bytes) -> dict[int, float]:
    ids = set(tokenizer.eos_token_ids)
    if closers:
        ids |= {i for i in range(tokenizer.vocab_size) if any(b in tokenizer.token_bytes(i) for b in closers)}
    return {i: -100.0 for i in ids}


def _decode(engine, work: Workload, spec: Optional[GuideSpec], bias: dict[int, float], seed: int) -> dict:
    """Steady decode (the clock starts when every request has its first token)."""
    for i, (ids, n) in enumerate(zip(work.prompts, work.output_lens)):
        params = SamplingParams(temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, seed=seed + i, max_tokens=n,
                                ignore_eos=True, logit_bias=bias, guided=spec)
        engine.add_request(EngineRequest(f"guided-bench-{i}", ids, params, thinking=False))
    started: set[str] = set()
    while len(started) < len(work.prompts) and engine.has_unfinished():
        started.update(e.request_id for e in engine.step() if e.token_ids)
    tokens, step_seconds = 0, []
    while engine.has_unfinished():
        begin = time.perf_counter()
        events = engine.step()
        step_seconds.append(time.perf_counter() - begin)
        tokens += sum(len(e.token_ids) for e in events)
    return {"tokens": tokens, "step_ms": 1000 * statistics.median(step_seconds or [0.0])}


def guided_overhead(engine, tokenizer, guides: list[str], levels: list[int], prompt_len: int, output_len: int,
                    seed: int = 0, rounds: int = 3) -> Iterator[dict]:
    """One record per (guide, concurrency): plain vs guided step time, the difference
    per step and per generated token, and the mask fill per step."""
    unknown = [g for g in guides if g not in GUIDES]
    if unknown:
        raise ValueError(f"unknown guide(s) {', '.join(unknown)}; choose from {', '.join(GUIDES)}")
    masks = engine.guided_masks
    if masks is None:
        raise RuntimeError("guided decoding is off in this engine (guided.backend: none)")
    for c in levels:
        work = fixed_workload(c, prompt_len, output_len, tokenizer.vocab_size, seed + c)
        for name in guides:
            spec, closers = GUIDES[name]
            bias = _closing_bias(tokenizer, closers)
            plain_ms, guided_ms, fill_us = [], [], []
            for _ in range(rounds):
                plain = _decode(engine, work, None, bias, seed)
                masks.take_fill_seconds()  # only the guided run's fills count
                guided = _decode(engine, work, spec, bias, seed)
                plain_ms.append(plain["step_ms"])
                guided_ms.append(guided["step_ms"])
                fill_us.append(1e6 * statistics.median(masks.take_fill_seconds() or [0.0]))
            overhead = min(guided_ms) - min(plain_ms)
            yield {
                "figure": "guided_decode", "guide": name, "concurrency": c,
                "plain_step_ms": min(plain_ms), "guided_step_ms": min(guided_ms),
                "overhead_ms_per_step": overhead, "overhead_us_per_token": 1000 * overhead / c,
                "mask_fill_us_per_step": min(fill_us), "decode_tokens": guided["tokens"],
            }
