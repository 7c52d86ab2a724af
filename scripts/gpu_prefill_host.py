#!/usr/bin/env python3
"""Where a chunked prefill's wall time goes on the host (GPU only).

A prefill of ``--prefill`` tokens in chunks of ``--chunk`` (the engine's default is
1,024), after an untimed one of another prompt, three ways in turn:

1. timed plainly (tokens per second);
2. under ``torch.cuda.set_sync_debug_mode("warn")``: every operation that made the host
   wait for the device (a read of a device value, a copy to pageable memory, an op whose
   output size depends on device data), counted by the innermost call site in this
   project or in a library it calls, so the syncs that leave the GPU idle while the host
   queues the next kernels have names;
3. under cProfile: the host functions with the most time of their own;
4. under torch's profiler: the torch operators that ran on the device, counted by the
   line that called them (the small launches between the kernels that do the work).

On the 35B-A3B (session 30, H100) an 8,192-token prompt took 5x as long in 1,024-token
chunks as in one chunk, in bf16 and FP8 alike, while one chunk's kernels kept the device
busy for less than half of its wall time. Prompts are not published to the prefix cache
unless ``--publish``: then, with a pool of two prompts, each evicts an older one into the
host KV tier (session 30's runs did, which put ~10,000 page copies a prompt into its
counts; session 31 batched them). One JSON line per part.

    python3 scripts/gpu_prefill_host.py random:qwen3.6-35b-a3b --prefill 8192 --chunk 1024
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import re
import sys
import time
import traceback
import warnings
from collections import Counter
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile
from gpu_step_profile import model_source  # noqa: E402 (scripts/ is on sys.path)

from ninfer import LLM, SamplingParams
from ninfer.engine.request import EngineRequest

ROOT = str(Path(__file__).resolve().parents[1])
FRAME = re.compile(r".+\(\d+\): ")


def call_site(stack: list[traceback.FrameSummary]) -> str:
    """The innermost frame outside torch and this script's own machinery (``file:line fn``)."""
    for frame in reversed(stack):
        name = frame.filename
        if "/torch/" in name or name == __file__ or "warnings.py" in name:
            continue
        return f"{name.replace(ROOT + '/', '')}:{frame.lineno} {frame.name}"
    return "?"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--prefill", type=int, default=8192)
    ap.add_argument("--chunk", type=int, default=1024)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--publish", action="store_true",
                    help="publish each prompt to the prefix cache: with a pool of two prompts, each then evicts an "
                         "older one into the host KV tier (session 30's runs did; the bench's prefill does not)")
    args = ap.parse_args()
    path, weights = model_source(args.model, torch.bfloat16, torch.device("cuda", 0))
    n = args.prefill
    llm = LLM(path, device="cuda", dtype="bf16", max_num_seqs=1, max_context=n + 8, kv_capacity=2 * (n + 8),
              prefill_chunk=args.chunk, weights=weights)
    vocab = llm.loaded.tokenizer.vocab_size
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    prompts = [{"prompt_token_ids": [(7 * i + r) % vocab for i in range(n)]} for r in range(5)]
    llm.generate(prompts[4], params)  # compiles and autotunes for these chunks

    def prefill(r: int) -> float:
        engine = llm.engine
        engine.add_request(EngineRequest(f"prefill-{r}-{time.monotonic_ns()}", prompts[r]["prompt_token_ids"], params,
                                         lookup_prefix_cache=False, commit_prefix_cache=args.publish))
        torch.cuda.synchronize()
        start = time.perf_counter()
        while engine.has_unfinished():  # a different prompt each time: no prefix reuse
            engine.step()
        torch.cuda.synchronize()
        return time.perf_counter() - start

    seconds = prefill(1)
    print(json.dumps({"part": "timed", "model": args.model, "prefill": n, "chunk": args.chunk, "publish": args.publish,
                      "seconds": round(seconds, 4), "tok_s": round(n / seconds, 1)}), flush=True)

    sites: Counter = Counter()
    shown = warnings.showwarning

    def record(message, category, filename, lineno, file=None, line=None):
        sites[call_site(traceback.extract_stack())] += 1

    torch.cuda.set_sync_debug_mode("warn")
    warnings.showwarning = record
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = record
            prefill(2)
    finally:
        torch.cuda.set_sync_debug_mode("default")
        warnings.showwarning = shown
    print(json.dumps({"part": "syncs", "chunks": -(-n // args.chunk), "total": sum(sites.values()),
                      "sites": dict(sites.most_common(args.top))}), flush=True)

    prof = cProfile.Profile()
    prof.enable()
    prefill(3)
    prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(args.top)
    print(json.dumps({"part": "host", "cprofile": text.getvalue()[-6000:]}), flush=True)

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True) as trace:
        prefill(0)
    print(json.dumps({"part": "torch ops", **ops_by_site(trace, args.top)}), flush=True)


def ops_by_site(trace, top: int) -> dict:
    """The torch operators that ran device work (the small launches between the Triton
    kernels; on a machine without CUDA, every operator), counted by the innermost Python
    line outside torch that called them."""
    sites: Counter = Counter()
    on_gpu = torch.cuda.is_available()
    for evt in trace.events():
        if not evt.name.startswith("aten::") or (on_gpu and getattr(evt, "self_device_time_total", 0) <= 0):
            continue
        sites[f"{evt.name} @ {caller(evt)}"] += 1
    return {"total": sum(sites.values()), "sites": dict(sites.most_common(top))}


def caller(evt) -> str:
    """The profiler records Python frames as the operator's parent events ("file(line): fn")."""
    parent = evt.cpu_parent
    while parent is not None:
        if FRAME.match(parent.name) and "torch/" not in parent.name:
            return parent.name.replace(ROOT + "/", "")
        parent = parent.cpu_parent
    return "?"


if __name__ == "__main__":
    sys.exit(main())
