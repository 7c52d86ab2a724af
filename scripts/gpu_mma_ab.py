"""int4 or FP8 on the tensor cores from registers (``kernels/triton/int4_mma.py``,
``fp8_mma.py``) against the kernels ``quant_gemm``'s table or heuristic picks without them
(the peer) and bf16 cuBLAS, at the 27B's quantized projections (and ``--shapes``) for 1 and
8 rows of x. Microseconds a product (graph replays over enough weight copies to read past
the L2), the share of copy bandwidth for the quantized bytes, the error against the
dequantized reference. Run on the GPU:

    python3 scripts/gpu_mma_ab.py [--format int4|fp8] [--rows 1,8] [--shapes 16384x5120,...]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from gpu_quant_gemm_sweep import copies_for, nbytes, pct, random_weight, time_us  # noqa: E402
from gpu_timing import rel_err  # noqa: E402

from ninfer_kernels.triton import fp8_mma, int4_mma  # noqa: E402
from ninfer_kernels.triton import quant_gemm as qg  # noqa: E402

#: the 27B's quantized products: in_proj (its quantized rows), DeltaNet and attention out,
#: gate/up, down, attention qkv
SHAPES = ((16384, 5120), (5120, 6144), (34816, 5120), (5120, 17408), (14336, 5120))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--format", default="int4", choices=("int4", "fp8"))
    ap.add_argument("--rows", default="1,8")
    ap.add_argument("--shapes", default=",".join(f"{n}x{k}" for n, k in SHAPES))
    ap.add_argument("--warps", default="4,8")
    ap.add_argument("--unroll", default="2", help="int4 only")
    ap.add_argument("--tiles", default="1,2")
    args = ap.parse_args()
    # quant_matmul: the table's kernels, the peer (the tensor-core kernel is called directly)
    os.environ["NINFER_INT4_MMA" if args.format == "int4" else "NINFER_FP8_MMA"] = "0"
    matmul = int4_mma.int4_mma_matmul if args.format == "int4" else fp8_mma.fp8_mma_matmul
    splits_for = int4_mma.mma_splits if args.format == "int4" else fp8_mma.fp8_splits
    gen = torch.Generator(device="cuda").manual_seed(4)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for shape in args.shapes.split(","):
        n, k = map(int, shape.split("x"))
        first = random_weight(args.format, n, k, gen=gen)
        ws = [first] + [random_weight(args.format, n, k, gen=gen) for _ in range(copies_for(nbytes(first), 1) - 1)]
        dense = [w.dequantize(torch.bfloat16) for w in ws[:max(2, copies_for(n * k * 2, 1))]]
        for rows in map(int, args.rows.split(",")):
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16, generator=gen)
            want = x.float() @ first.dequantize().T
            config = qg.choose_config(x, qg.operands(first))
            row = {"n": n, "k": k, "rows": rows, "format": args.format, "bytes": nbytes(first)}
            us = time_us([lambda w=w: qg.quant_matmul(x, w) for w in ws])
            row["packed"] = {"config": config.to_json(), "us": round(us, 2), "pct_copy_bw": pct(nbytes(first), us),
                             "rel_err": round(rel_err(qg.quant_matmul(x, first), want), 5)}
            us = time_us([lambda d=d: F.linear(x, d) for d in dense])
            row["bf16"] = {"us": round(us, 2), "pct_copy_bw": pct(n * k * 2, us)}
            best = None
            # int4's K loop takes an unroll factor; FP8's is never unrolled (fp8_mma_matmul)
            unrolls = list(map(int, args.unroll.split(","))) if args.format == "int4" else [None]
            for warps, tiles, unroll in itertools.product(
                    *(list(map(int, v.split(","))) for v in (args.warps, args.tiles)), unrolls):
                auto = splits_for(n, k, warps, sms, tiles)
                extra = {} if unroll is None else {"unroll": unroll}
                for splits in sorted({max(1, auto // 2), auto, 2 * auto}):
                    def call(m, warps=warps, splits=splits, tiles=tiles, extra=extra):
                        return matmul(x, m, num_warps=warps, splits=splits, tiles=tiles, **extra)
                    us = time_us([lambda w=w: call(w) for w in ws])
                    err = rel_err(call(first), want)
                    entry = {"warps": warps, "tiles": tiles, "splits": splits, **extra,
                             "us": round(us, 2), "pct_copy_bw": pct(nbytes(first), us), "rel_err": round(err, 5)}
                    print(json.dumps({"n": n, "k": k, "rows": rows, "mma": entry}), file=sys.stderr, flush=True)
                    if best is None or us < best["us"]:
                        best = entry
            row["mma_best"] = best
            row["mma_vs_packed"] = round(row["packed"]["us"] / best["us"], 3)
            row["mma_vs_bf16"] = round(row["bf16"]["us"] / best["us"], 3)
            print(json.dumps(row), flush=True)
        del ws, dense


if __name__ == "__main__":
    main()
