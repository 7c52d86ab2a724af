"""Device time of the LM head and greedy pick at decode batch sizes (GPU only).

Times, from a CUDA graph of 8 calls back to back, the ways to get float32 logits of the
8B shape's LM head (``F.linear`` then ``.float()``, or one matmul that writes float32
through ``torch.mm(..., out_dtype=)``) and the argmax over them. Prints one JSON line per
batch size and variant, in device microseconds per call.

    python scripts/gpu_lm_head_sweep.py --batch 1,8
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from gpu_timing import bench, graphed  # noqa: E402 (scripts/ is on sys.path)

HIDDEN, VOCAB, CALLS = 4096, 151936, 8


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", default="1,8")
    args = ap.parse_args()
    dev = torch.device("cuda")
    w = (torch.randn(VOCAB, HIDDEN, dtype=torch.bfloat16, device=dev) * 0.02).t().contiguous().t()
    for m in map(int, args.batch.split(",")):
        x = torch.randn(m, HIDDEN, dtype=torch.bfloat16, device=dev)
        logits = F.linear(x, w).float()
        variants = {
            "linear_then_float": lambda: F.linear(x, w).float(),
            "linear_bf16": lambda: F.linear(x, w),
            "argmax_float32": lambda: logits.argmax(-1),
            "argmax_bf16": lambda: logits.bfloat16().argmax(-1),
        }
        try:
            torch.mm(x, w.t(), out_dtype=torch.float32)
            variants["mm_out_float32"] = lambda: torch.mm(x, w.t(), out_dtype=torch.float32)
        except (RuntimeError, TypeError) as e:
            print(json.dumps({"batch": m, "variant": "mm_out_float32", "error": str(e)[:200]}))
        for name, fn in variants.items():
            replay = graphed(lambda fn=fn: [fn() for _ in range(CALLS)])
            us = bench(replay) * 1000 / CALLS
            print(json.dumps({"batch": m, "variant": name, "us_per_call": round(us, 2)}), flush=True)


if __name__ == "__main__":
    main()
