"""GPU smoke check: the same engine code on CUDA gives the CPU's greedy tokens (fp32).

Run on a CUDA machine: ``python scripts/gpu_smoke.py --out smoke.json``. Exits 1 on a
mismatch. Also runs bf16 on CUDA and checks every request finishes with tokens.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from ninfer import LLM, SamplingParams

PROMPTS = ["Hello", "The quick brown fox", "def f(x):\n    return", "1 2 3 4 5 6 7 8", "Paged attention"]


def run(device: str, dtype: str, family: str) -> tuple[list[list[int]], float]:
    llm = LLM(f"tiny:{family}", device=device, dtype=dtype, max_concurrency=8, prefill_chunk=7, block_size=16,
              max_context=512, kv_capacity=4096)
    start = time.perf_counter()
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs], time.perf_counter() - start


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    args = p.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    report, ok = {}, True
    for family in ("qwen3", "qwen3_moe"):
        cpu, _ = run("cpu", "fp32", family)
        gpu, secs = run("cuda", "fp32", family)
        same = sum(a == b for a, b in zip(cpu, gpu))
        bf16, _ = run("cuda", "bf16", family)
        report[family] = {"fp32_cuda_equals_cpu": f"{same}/{len(cpu)}", "fp32_cuda_seconds": secs,
                          "bf16_tokens": [len(t) for t in bf16]}
        ok &= same == len(cpu) and all(len(t) == 24 for t in bf16)
    report["ok"] = ok
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print(json.dumps(report))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
