"""One decode-sized product, launched inside an NVTX range for Nsight Compute to read.

The one-row FP8 and int4 steps read their weights at 50-75% of copy bandwidth where bf16
cuBLAS reads at about 90%. Timing variants says how long a kernel takes, not what holds
it back; the hardware counters say whether the memory system, the issue slots or the
number of warps in flight is the limit. Run under ``ncu`` (``gpu_session.sh gemv-ncu``):

    ncu --clock-control none --nvtx --nvtx-include "probe/" ... \\
        python3 scripts/gpu_gemv_ncu.py --format int4 --n 16480 --k 5120

``--format bf16`` launches the dense cuBLAS product of the same shape, the peer; ``int4``
and ``fp8`` are the tensor-core kernels at up to eight rows (``kernels/triton/int4_mma.py``,
``fp8_mma.py``), ``int4-packed`` and ``fp8-table`` what the table picks without them.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from gpu_quant_gemm_sweep import random_weight  # noqa: E402

from ninfer_kernels.triton import fp8_mma, int4_mma  # noqa: E402
from ninfer_kernels.triton import quant_gemm as qg  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--format", default="int4", choices=("fp8", "fp8-table", "int4", "int4-packed", "nvfp4", "bf16"))
    ap.add_argument("--n", type=int, default=16480)
    ap.add_argument("--k", type=int, default=5120)
    ap.add_argument("--rows", type=int, default=1)
    args = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(5)
    x = torch.randn(args.rows, args.k, device="cuda", dtype=torch.bfloat16, generator=gen)
    if args.format == "bf16":
        dense = torch.randn(args.n, args.k, device="cuda", dtype=torch.bfloat16, generator=gen)
        fn = lambda: x @ dense.T  # noqa: E731
    else:
        fmt = args.format.removesuffix("-packed").removesuffix("-table")
        os.environ["NINFER_INT4_MMA"] = os.environ["NINFER_FP8_MMA"] = "0" if fmt != args.format else "1"
        w = random_weight(fmt, args.n, args.k, gen=gen)
        fn = lambda: qg.quant_matmul(x, w)  # noqa: E731  (the committed table's shape)
        mma = {"int4": int4_mma, "fp8": fp8_mma}.get(args.format)
        if mma is not None and mma.takes(x, w):
            print("config: tensor cores, (warps, tiles)", mma.launch_shape(args.rows))
        else:
            print("config:", qg.choose_config(x, qg.operands(w)).to_json())
    for _ in range(3):  # compiled and warm before the range opens
        fn()
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_push("probe")
    fn()
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_pop()


if __name__ == "__main__":
    main()
