"""Time decode's skinny matmuls under each cuBLAS setup torch offers (GPU only).

For every projection of a Qwen3-8B layer (and the LM head) and each batch size, times
``F.linear`` replayed from a CUDA graph (36 calls back to back, as in a decode step)
with the weight row-major or column-major, posed as ``x @ W^T`` or ``(W @ x^T)^T``,
through cuBLAS or cuBLASLt, and optionally with the reduced-precision split-K
reduction allowed or not. Prints one JSON line per setup:
microseconds per call, the share of copy bandwidth the weight read reaches, and the
kernels the call launched (a split-K reduction shows up as a second kernel).

    python scripts/gpu_gemm_sweep.py --batch 1,8
"""

from __future__ import annotations

import argparse
import json
from collections import Counter

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from gpu_timing import bench, graphed  # noqa: E402 (scripts/ is on sys.path)
from ninfer.bench.bandwidth import copy_bandwidth

#: (name, in features, out features) of the 8B shape
SHAPES = (("qkv", 4096, 6144), ("o", 4096, 4096), ("gate_up", 4096, 24576), ("down", 12288, 4096),
          ("lm_head", 4096, 151936))
REPEATS = 36


def kernels(fn) -> list[str]:
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names = Counter(e.name[:70] for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    return [f"{n} x{c}" for n, c in names.items()]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", default="1,8")
    ap.add_argument("--libs", default="cublas,cublaslt")
    ap.add_argument("--reductions", action="store_true", help="also time with bf16 reduced-precision split-K off")
    args = ap.parse_args()
    dev = torch.device("cuda")
    copy_bw = copy_bandwidth(dev)
    print(json.dumps({"copy_bandwidth_gb_s": copy_bw / 1e9}), flush=True)
    for name, k, n in SHAPES:
        w_rows = torch.randn(n, k, dtype=torch.bfloat16, device=dev) * 0.02
        w_cols = w_rows.t().contiguous().t()
        repeats = 4 if name == "lm_head" else REPEATS
        for m in map(int, args.batch.split(",")):
            x = torch.randn(m, k, dtype=torch.bfloat16, device=dev)
            for lib in args.libs.split(","):
                torch.backends.cuda.preferred_blas_library(lib)
                for reduced in (True, False) if args.reductions else (True,):
                    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = reduced
                    for layout, w in (("rows", w_rows), ("cols", w_cols)):
                        # "linear": x @ W^T as F.linear asks; "transposed": (W @ x^T)^T, the
                        # same product posed to cuBLAS with the batch as the narrow side
                        for form, op in (("linear", lambda w=w: F.linear(x, w)),
                                         ("transposed", lambda w=w: torch.mm(w, x.t()).t())):
                            fn = graphed(lambda op=op: [op() for _ in range(repeats)])
                            us = bench(fn, rep=50, warmup=10) * 1000 / repeats
                            print(json.dumps({
                                "gemm": name, "m": m, "lib": lib, "bf16_reduced_reduction": reduced,
                                "layout": layout, "form": form, "us": round(us, 2),
                                "bw_share": round(w.numel() * 2 / (us * 1e-6) / copy_bw, 3),
                                "kernels": kernels(op),
                            }), flush=True)
    torch.backends.cuda.preferred_blas_library("cublas")


if __name__ == "__main__":
    main()
