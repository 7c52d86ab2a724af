"""Where the device time of whole engine decode steps goes (GPU only).

Unlike ``gpu_decode_profile.py``, which profiles the replayed graph alone, this runs the
real engine (scheduler, graph inputs, LM head, sampler, steps queued ahead) on a
checkpoint and profiles ``--steps`` steady decode steps. One JSON line per concurrency:
the step time, how much of the window the device was busy (the union of kernel and copy
intervals) and the busiest kernels and copies per step, so launch gaps and the work
outside the graph show up next to the graph's kernels.

    python scripts/gpu_step_profile.py random:qwen3-8b --concurrency 1,8
    python scripts/gpu_step_profile.py random:qwen3.6-27b --prefill 8192     # one 8k prefill
    python scripts/gpu_step_profile.py random:qwen3.6-27b --concurrency 8 --prompt-len 131072 \
        --synthetic-context --kv-dtype fp8            # long contexts without their prefill
    python scripts/gpu_step_profile.py random:train-gpu-deep --concurrency 1 --spec mtp --draft-tokens 3
        # a step is then a speculative round (verify, drafts, verdict); random weights accept
        # next to nothing, which leaves a round's cost as it is
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import tempfile
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from ninfer import LLM
from ninfer.model.sources import resolve_source
from ninfer.plugins import load_registry
from ninfer.bench.ninfer_runs import _submit, synthetic_contexts
from ninfer.bench.workload import fixed_workload

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")

#: kernel kinds for the per-kind summary: (kind, pattern of the kernel name), first match wins
KINDS = (
    ("moe gate_up", r"_gate_up_kernel|_gate_up_one_kernel"),
    ("moe down", r"_down_kernel|_down_one_kernel|_down_sum_one_kernel"),
    ("moe sum", r"_sum_pairs_kernel"),
    ("moe route", r"_route_kernel"),
    ("gated deltanet decode", r"_gdn_decode_kernel|_recurrent_kernel"),
    ("gated deltanet chunked (fla)", r"chunk|solve_tril|recompute_w_u|kkt|l2norm|merge_16x16|wy_fast"),
    ("causal conv", r"_causal_conv_kernel"),
    ("decode attention", r"_decode_kernel|_merge_partials|_attend_quant_kernel|_norm_rope_write_kernel"),
    ("prefill attention", r"_attend_kernel|_merge_kernel|_write_kv_kernel|_qk_norm_rope_kernel|_rope_kernel"),
    ("rmsnorm", r"_rms_norm_kernel|_gated_rms_norm_kernel"),
    ("moe align", r"_align"),
    ("silu and mul", r"_silu_and_mul_kernel"),
    ("skinny linear (Triton)", r"_skinny_kernel"),
    ("quantized linear (Triton)", r"_quant_gemm_kernel|_act_quant_kernel"),
    ("matmul (cuBLAS)", r"gemm|nvjet|cutlass|sm90_|xmma|splitK|gemv"),
    ("sampler / argmax", r"argmax|reduce_kernel|topk|sort|softmax"),
    ("elementwise (torch)", r"elementwise|vectorized|unrolled|index|gather|scatter|copy|cat"),
)


def kind_of(cat: str, name: str) -> str:
    if cat != "kernel":
        return cat  # gpu_memcpy / gpu_memset
    for kind, pattern in KINDS:
        if re.search(pattern, name):
            return kind
    return "other"


def device_intervals(trace_path: str) -> list[tuple[float, float, str, str]]:
    """(start us, end us, category, name) of every device activity in a chrome trace."""
    with open(trace_path) as f:
        events = json.load(f)["traceEvents"]
    out = []
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in GPU_CATEGORIES:
            out.append((float(e["ts"]), float(e["ts"]) + float(e["dur"]), e["cat"], e["name"]))
    return sorted(out)


def busy_us(intervals) -> float:
    """Length of the union of the intervals (overlapping kernels under PDL count once)."""
    total, end = 0.0, None
    for s, e, *_ in intervals:
        if end is None or s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total


def profile_steps(engine, steps: int) -> tuple[float, list]:
    """Run ``steps`` engine steps under the profiler; returns (wall ms per step, intervals)."""
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - start) * 1000 / steps
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        return wall, device_intervals(path)


def summarise(intervals, steps: int, top: int) -> dict:
    """Per kernel kind and the busiest kernels, per step."""
    per_name: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0.0, 0])
    for s, e, cat, name in intervals:
        per_name[(cat, name[:80])][0] += e - s
        per_name[(cat, name[:80])][1] += 1
    per_kind: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for (cat, name), (us, n) in per_name.items():
        per_kind[kind_of(cat, name)][0] += us
        per_kind[kind_of(cat, name)][1] += n
    rows = sorted(per_name.items(), key=lambda kv: -kv[1][0])
    return {
        "device_busy_ms_per_step": round(busy_us(intervals) / 1000 / steps, 4),
        "kinds": {kind: {"us_per_step": round(us / steps, 1), "launches_per_step": n / steps}
                  for kind, (us, n) in sorted(per_kind.items(), key=lambda kv: -kv[1][0])},
        "top": [{"cat": cat, "name": name, "us_per_step": round(us / steps, 2), "per_step": n / steps}
                for (cat, name), (us, n) in rows[:top]],
    }


def profile_prefill(args) -> None:
    """One prefill of ``args.prefill`` tokens in one chunk, profiled after an untimed one."""
    from ninfer import SamplingParams

    path, weights = resolve_source(args.model, load_registry(), torch.bfloat16, torch.device("cuda", 0))
    n = args.prefill
    llm = LLM(str(path), device="cuda", dtype="bf16", max_num_seqs=1, max_context=n + 8, kv_capacity=2 * (n + 8),
              prefill_chunk=n, weights=weights)
    vocab = llm.loaded.tokenizer.vocab_size
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    prompts = [{"prompt_token_ids": [(7 * i + r) % vocab for i in range(n)]} for r in range(2)]
    llm.generate(prompts[0], params)  # compiles and autotunes for this length
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        llm.generate(prompts[1], params)  # a different prompt: no prefix reuse
        torch.cuda.synchronize()
        wall = (time.perf_counter() - start) * 1000
    with tempfile.TemporaryDirectory() as tmp:
        trace = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(trace)
        intervals = device_intervals(trace)
    print(json.dumps({"prefill_tokens": n, "wall_ms": round(wall, 2), **summarise(intervals, 1, args.top)}),
          flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", default="random:qwen3-8b")
    ap.add_argument("--concurrency", default="1,8")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--host", action="store_true", help="also a cProfile of the host's side of the steps")
    ap.add_argument("--kv-dtype", default="bf16")
    ap.add_argument("--synthetic-context", action="store_true",
                    help="prompts count as computed without a prefill (ninfer-bench's option of that name)")
    ap.add_argument("--spec", help="a speculative backend (mtp): each step is then a round")
    ap.add_argument("--draft-tokens", type=int, default=3)
    ap.add_argument("--lm-head-draft", type=int, default=0, metavar="N",
                    help="with --spec: draft over the shortlist's N most frequent tokens")
    ap.add_argument("--prefill", type=int, default=0, metavar="LEN",
                    help="instead: profile one prefill of LEN tokens (one chunk), after an untimed one")
    args = ap.parse_args()
    if args.prefill:
        return profile_prefill(args)
    levels = [int(c) for c in args.concurrency.split(",")]
    path, weights = resolve_source(args.model, load_registry(), torch.bfloat16, torch.device("cuda", 0))
    spec = dict(spec=args.spec, draft_tokens=args.draft_tokens) if args.spec else {}
    if args.spec and args.lm_head_draft:
        spec.update(lm_head_draft=True, lm_head_draft_size=args.lm_head_draft)
    llm = LLM(str(path), device="cuda", dtype="bf16", max_num_seqs=max(levels), max_context=args.prompt_len + 1024,
              kv_capacity=(args.prompt_len + 1024) * max(levels), weights=weights, decode_ahead=True,
              kv_dtype=args.kv_dtype, **spec)
    engine = llm.engine
    vocab = llm.loaded.tokenizer.vocab_size
    for c in levels:
        work = fixed_workload(c, args.prompt_len, (5 if args.host else 3) * args.steps + 64, vocab, c)
        with synthetic_contexts(engine) if args.synthetic_context else contextlib.nullcontext():
            _submit(engine, work, f"prof{c}-", args.synthetic_context)
            for _ in range(args.steps):  # prefill, then settle into steady decode
                engine.step()
        if args.host:  # where the host's share of a step goes (cProfile, top by own time)
            import cProfile
            import io
            import pstats

            prof = cProfile.Profile()
            prof.enable()
            for _ in range(args.steps):
                engine.step()
            prof.disable()
            text = io.StringIO()
            pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(18)
            print(f"host profile, concurrency {c}, {args.steps} steps:\n" + text.getvalue()[-3500:], flush=True)
        wall, intervals = profile_steps(engine, args.steps)
        while engine.has_unfinished():
            engine.step()
        # the window: first to last device activity of the profiled steps
        window = intervals[-1][1] - intervals[0][0]
        print(json.dumps({
            "concurrency": c, "spec": args.spec, "draft_tokens": args.draft_tokens if args.spec else 0,
            "kv_dtype": args.kv_dtype, "context": args.prompt_len, "steps": args.steps, "wall_ms_per_step": round(wall, 4),
            "device_window_ms_per_step": round(window / 1000 / args.steps, 4),
            "activities_per_step": len(intervals) / args.steps,
            **summarise(intervals, args.steps, args.top),
        }), flush=True)


if __name__ == "__main__":
    main()
