"""The ``spec_decode`` figure: decode with and without speculation on the same prompts.

Acceptance depends on the text, so one prompt is a poor sample: at every concurrency the
figure decodes the same :data:`SAMPLE_PROMPTS` prompts, ``SAMPLE_PROMPTS / c`` batches of
``c`` one after another (sixteen single requests at c=1, two batches of eight at c=8), and
reports their pooled rate and acceptance. With ``--spec-prompts`` the prompts are windows
spread evenly over the whole text, as ``ninfer-train``'s report picks its own (its first
stretches alone are one file's header and docstrings, not a sample of the text). Each
concurrency first decodes a short untimed batch, so kernels that compile on first use
(the verify and draft shapes of this batch size) do it there; session 21's first timed
runs had them inside the clock.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ninfer.bench import ninfer_runs
from ninfer.bench.workload import Workload, fixed_workload
from ninfer.train.report import windows

#: prompts every concurrency decodes (in batches of c)
SAMPLE_PROMPTS = 16


def prompt_ids(tokenizer, spec_prompts: str | None) -> list[int] | None:
    """The token ids of ``--spec-prompts`` (None: random prompts)."""
    if not spec_prompts:
        return None
    return tokenizer.encode(Path(spec_prompts).read_text(encoding="utf-8", errors="replace"))


def text_windows(ids: list[int], count: int, length: int) -> list[list[int]]:
    """``count`` non-overlapping windows of ``length`` tokens spread evenly over ``ids``, as
    ``ninfer-train``'s report picks its prompts (:func:`ninfer.train.report.windows`)."""
    if len(ids) // length < count:
        raise ValueError(f"the text has {len(ids)} tokens; {count} prompts of {length} need more")
    return windows(torch.tensor(ids), length, count).tolist()


def batch_work(ids: list[int] | None, c: int, batch: int, prompt_len: int, output_len: int, vocab: int,
               seed: int) -> Workload:
    """Batch ``batch`` of ``c`` prompts: the next ``c`` of the sample's text windows (or
    random ids when there is no text)."""
    if ids is None:
        return fixed_workload(c, prompt_len, output_len, vocab, seed + 1000 * batch + c)
    windows = text_windows(ids, max(SAMPLE_PROMPTS, c), prompt_len)
    return Workload(windows[batch * c:(batch + 1) * c], [output_len] * c)


def measure(engine, ids: list[int] | None, c: int, prompt_len: int, output_len: int, vocab: int,
            seed: int) -> tuple[dict, object]:
    """The pooled decode figure of the sample at concurrency ``c`` and the engine's interval
    statistics over it (acceptance)."""
    ninfer_runs.decode_throughput(engine, batch_work(ids, c, 0, prompt_len, 32, vocab, seed))  # untimed
    engine.stats.take_interval()  # the interval counters now cover the sample only
    runs = [ninfer_runs.decode_throughput(engine, batch_work(ids, c, b, prompt_len, output_len, vocab, seed))
            for b in range(max(1, SAMPLE_PROMPTS // c))]
    stats = engine.stats.take_interval()
    tokens = sum(r["decode_tokens"] for r in runs)
    seconds = sum(r["seconds"] for r in runs)
    steps = sum(r["steps"] for r in runs)
    pooled = {}
    for key in ("host_ms", "device_wait_ms"):  # weighted by each run's steps, as step_ms is
        timed = [r for r in runs if key in r]
        if timed:
            pooled[key] = round(sum(r[key] * r["steps"] for r in timed) / sum(r["steps"] for r in timed), 4)
    if any("host_steps" in r for r in runs):
        pooled["host_steps"] = sum(r.get("host_steps", 0) for r in runs)
    return {
        "decode_tokens": tokens,
        "seconds": seconds,
        "decode_tok_s": tokens / seconds if seconds else 0.0,
        "step_ms": 1000 * seconds / steps if steps else 0.0,
        "steps": steps,
        "full_batch": all(r["full_batch"] for r in runs),
        "prompts": len(runs) * c,
        **pooled,
    }, stats
