"""The one-row int4 and FP8 steps with their scales and x loaded a step ahead (a config's
``ahead``), and with their K loop unrolled three times (``unroll``, with 16- and 8-byte
loads: ``vec``), against neither, at the 27B's projections: int4 with
the device's table shapes, FP8 on the gemv step with the H100 table's shapes (the H200's
table takes tensor-core tiles there). Microseconds a product (graph replays over enough
weight copies to read past the L2) and the share of copy bandwidth. Run on the GPU:

    python3 scripts/gpu_int4_ahead_ab.py
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from gpu_quant_gemm_sweep import copies_for, nbytes, pct, random_weight, time_us  # noqa: E402
from gpu_timing import rel_err  # noqa: E402

from ninfer_kernels.triton import quant_gemm as qg  # noqa: E402

SHAPES = ((16480, 5120), (5120, 6144), (34816, 5120), (5120, 17408), (14336, 5120))
#: the FP8 gemv step's split counts (H100 table, session 23), by shape
FP8_SPLITS = {(16480, 5120): 3, (5120, 6144): 7, (34816, 5120): 1, (5120, 17408): 7, (14336, 5120): 3}


def main() -> None:
    gen = torch.Generator(device="cuda").manual_seed(4)
    for fmt in ("int4", "fp8"):
        for n, k in SHAPES:
            first = random_weight(fmt, n, k, gen=gen)
            ws = [first] + [random_weight(fmt, n, k, gen=gen) for _ in range(copies_for(nbytes(first), 1) - 1)]
            x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16, generator=gen)
            want = x.float() @ first.dequantize().T
            config = (qg.choose_config(x, qg.operands(first)) if fmt == "int4" else
                      qg.QuantGemmConfig(1, 128, 128, SPLITS=FP8_SPLITS[(n, k)], num_stages=4, gemv=True))
            row = {"format": fmt, "n": n, "k": k, "config": config.to_json()}
            for ahead, unroll, vec in ((True, 1, 4), (False, 1, 4), (False, 3, 4), (False, 3, 2)):
                cfg = replace(config, ahead=ahead, unroll=unroll, vec=vec)
                us = time_us([lambda w=w, cfg=cfg: qg.quant_matmul(x, w, None, cfg) for w in ws])
                row[f"ahead={ahead},unroll={unroll},vec={vec}"] = {"us": round(us, 2), "pct_copy_bw": pct(nbytes(first), us),
                                         "rel_err": round(rel_err(qg.quant_matmul(x, first, None, cfg), want), 5)}
            print(json.dumps(row), flush=True)
            del ws, first

if __name__ == "__main__":
    main()
