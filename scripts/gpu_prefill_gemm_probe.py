"""Prefill-sized products of the 27B's quantized projections, every route side by side.

For each (rows, N, K) and weight format: bf16 cuBLAS on the dense weight (the peer), our
Triton kernel (table or heuristic, and the sweep's prefill candidates), torch's
``scaled_mm`` with DeepSeek-style block scales (FP8 only, where this torch has it), and
"dequantize to a bf16 scratch, then cuBLAS". Each route's error is against x @ W^T in
float32. One JSON line per route; run on the GPU:

    python3 scripts/gpu_prefill_gemm_probe.py [--rows 1024,8192] [--formats fp8,int4,nvfp4]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from gpu_quant_gemm_sweep import random_weight  # noqa: E402
from quant_candidates import PREFILL_FP8  # noqa: E402
from gpu_timing import bench, rel_err  # noqa: E402

from ninfer_kernels.triton import quant_gemm as qg  # noqa: E402
from ninfer_kernels.triton import cublas_prefill as cp  # noqa: E402

SHAPES = ((34816, 5120), (5120, 17408), (16480, 5120), (14336, 5120), (5120, 6144))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1024,8192", help="row counts (the default prefill chunk, and a long one)")
    ap.add_argument("--formats", default="fp8,int4,nvfp4")
    ap.add_argument("--shapes", type=int, default=len(SHAPES))
    args = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(3)
    for rows in map(int, args.rows.split(",")):
        for n, k in SHAPES[: args.shapes]:
            probe(rows, n, k, args.formats.split(","), gen)


def probe(rows: int, n: int, k: int, formats: list[str], gen: torch.Generator) -> None:
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16, generator=gen)
    flops = 2 * rows * n * k
    for fmt in formats:
        w = random_weight(fmt, n, k, gen=gen)
        dense = w.dequantize(torch.bfloat16)
        want = x.float() @ w.dequantize().T
        routes = {"bf16 cuBLAS (peer)": lambda: x @ dense.T,
                  "ours, table or heuristic": lambda: qg.quant_matmul(x, w),
                  "dequantize + cuBLAS": lambda: cp.dense_matmul(x, w)}
        if fmt == "fp8":
            for cfg in PREFILL_FP8:
                routes[f"ours {cfg.BLOCK_M}x{cfg.BLOCK_N} w{cfg.num_warps} s{cfg.num_stages}"] = \
                    lambda cfg=cfg: qg.quant_matmul(x, w, None, cfg)
            routes[f"block-scaled cuBLAS (available: {cp.block_scaled_available(x, w)})"] = \
                lambda: cp.block_scaled_matmul(x, w)
        for name, fn in routes.items():
            row = {"rows": rows, "n": n, "k": k, "format": fmt, "route": name}
            try:
                row["rel_err"] = round(rel_err(fn(), want), 5)
                us = bench(fn, rep=50, warmup=10) * 1e3
                row.update(us=round(us, 1), tflops=round(flops / us / 1e6, 1))
            except Exception as exc:  # noqa: BLE001  (report and go on)
                row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            print(json.dumps(row), flush=True)
        del w, dense, want


if __name__ == "__main__":
    main()
