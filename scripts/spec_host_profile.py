"""Where a speculative round's host time goes: cProfile of ``LLM.generate`` with a draft model.

    python scripts/spec_host_profile.py MODEL --draft-tokens 3 --concurrency 1 --prompts heldout.txt

Runs the prompts once to warm up, then again under cProfile, and prints the wall time,
the steps, and the functions by cumulative and by own time. On a small model the round
is host work almost entirely, so this is the figure to shrink (docs/performance.md).
Works on CPU too (the forward pass is then part of what it measures).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

from ninfer import LLM, SamplingParams


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("--spec", default="mtp")
    p.add_argument("--draft-tokens", type=int, default=3)
    p.add_argument("--concurrency", type=int, default=1)
    p.add_argument("--prompts", required=True, help="a text file; prompts are 400-character slices of it")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--top", type=int, default=40)
    a = p.parse_args()
    llm = LLM(a.model, dtype=a.dtype, device=a.device, spec=a.spec, draft_tokens=a.draft_tokens,
              max_concurrency=max(a.concurrency, 1))
    text = open(a.prompts, encoding="utf-8", errors="replace").read()
    prompts = [text[i * 3000 : i * 3000 + 400] for i in range(a.concurrency)]
    params = SamplingParams(temperature=0, max_tokens=a.max_tokens, ignore_eos=True)
    llm.generate(prompts, params)
    llm.engine.reset_stats()
    prof = cProfile.Profile()
    start = time.perf_counter()
    prof.enable()
    llm.generate(prompts, params)
    prof.disable()
    wall = time.perf_counter() - start
    steps = llm.engine.stats.steps
    print(f"wall {wall:.4f} s, {steps} steps, {1000 * wall / max(steps, 1):.3f} ms a step")
    stats = pstats.Stats(prof)
    stats.sort_stats("cumulative").print_stats(a.top)
    stats.sort_stats("tottime").print_stats(a.top // 2)


if __name__ == "__main__":
    main()
