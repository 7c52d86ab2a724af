"""Time the fused add + RMSNorm at decode shapes for each warp count (GPU only).

36 launches back to back (one per layer of the 8B shape) replayed from a CUDA graph, per
row count and warp count; one JSON line each. The launch mirrors
``ninfer_kernels.triton.norm.rms_norm`` except for ``num_warps``.

    python scripts/gpu_norm_sweep.py --rows 1,8 --hidden 4096
"""

from __future__ import annotations

import argparse
import json

import torch
import triton

from gpu_timing import bench, graphed  # noqa: E402 (scripts/ is on sys.path)
from ninfer_kernels.triton import norm

LAYERS = 36


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,8")
    ap.add_argument("--hidden", type=int, default=4096)
    args = ap.parse_args()
    n = args.hidden
    for rows in map(int, args.rows.split(",")):
        x = torch.randn(rows, n, dtype=torch.bfloat16, device="cuda")
        res = torch.randn_like(x)
        w = torch.rand(n, dtype=torch.bfloat16, device="cuda") + 0.5
        out, new_res = torch.empty_like(x), torch.empty_like(x)
        block_n = triton.next_power_of_2(n)
        per_program = max(1, min(64, norm.TILE_ELEMENTS // block_n))
        for warps in (1, 2, 4, 8, 16):
            def launch(warps=warps):
                norm._rms_norm_kernel[(triton.cdiv(rows, per_program),)](
                    x, res, w, out, new_res, rows, rows, 1e-6, 0, n, 0, n,
                    N=n, BLOCK_N=block_n, ROWS=per_program, HAS_RESIDUAL=True, USE_PDL=False, num_warps=warps)
            ms = bench(graphed(lambda: [launch() for _ in range(LAYERS)]), rep=50, warmup=10)
            print(json.dumps({"rows": rows, "hidden": n, "warps": warps, "us": round(ms * 1000 / LAYERS, 2),
                              "default_warps": min(16, max(1, per_program * block_n // 512))}), flush=True)


if __name__ == "__main__":
    main()
