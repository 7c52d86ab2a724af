"""Autotune flash-linear-attention's chunked Gated DeltaNet kernels at the engine's call
shapes and keep the results as this card's table (GPU).

fla autotunes at each new key; on a cold Triton cache that compiles every candidate of
every kernel (H100: 42 s of the 27B's 96 s cold start, sessions 39 and 40). This script calls
``fla_forward`` exactly as the engine's prefill does (packed sequences, first chunks and
continued ones, the model's dtype) for each shape's Gated DeltaNet heads, lets fla autotune
with the table off, and merges what its autotuners chose into
``kernels/triton/fla_configs/<device>.json`` (``--out DIR``: a copy under DIR too), which
``kernels/triton/fla_tuned.py`` then pins at startup. Autotuning results cached on disk are
not read: fla caches its timings in the Triton cache under a key naming the architecture,
not the card, so an H200 would read back an H100's (the cache travels in ``.tcache``).

    python scripts/gpu_fla_tune.py --shapes qwen3.6-27b,qwen3.6-35b-a3b,train-gpu-deep --out $OUT
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import time

# tune afresh: nothing pinned from an earlier table, no timings read back from the Triton cache
# (fla caches them by default, Triton with TRITON_CACHE_AUTOTUNING)
os.environ["NINFER_FLA_PIN"] = "0"
os.environ["FLA_CACHE_RESULTS"] = "0"
os.environ["TRITON_CACHE_AUTOTUNING"] = "0"

import torch  # noqa: E402

from ninfer.model.random_weights import SHAPES  # noqa: E402
from ninfer_kernels.triton import fla_tuned, gated_delta  # noqa: E402
from ninfer_kernels.triton.gated_delta import fla_forward  # noqa: E402
from ninfer_kernels.triton.tuned_tables import device_name, table_to_extend, write_table  # noqa: E402

#: (sequence lengths in one step, whether they continue from a state): a first 8k chunk, the
#: default 1,024-token chunks alone and beside a short prompt, a later chunk, the warm-up's
CASES = [((8192,), False), ((1024,), False), ((1024, 17), False), ((1024,), True), ((2049,), False),
         ((1024, 33), True)]


def run_shape(name: str, device: torch.device, dtype: torch.dtype) -> None:
    cfg = SHAPES[name]
    hk, hv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    dk, dv = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
    for lens, continuing in CASES:
        tokens = sum(lens)
        gen = torch.Generator(device=device).manual_seed(0)
        q = torch.randn(tokens, hk, dk, device=device, dtype=dtype, generator=gen)
        k = torch.randn(tokens, hk, dk, device=device, dtype=dtype, generator=gen)
        v = torch.randn(tokens, hv, dv, device=device, dtype=dtype, generator=gen)
        g = -torch.rand(tokens, hv, device=device, generator=gen)
        beta = torch.rand(tokens, hv, device=device, dtype=dtype, generator=gen)
        initial = torch.zeros(len(lens), hv, dk, dv, device=device) if continuing else None
        cu_cpu = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.long)
        started = time.perf_counter()
        fla_forward(q, k, v, g, beta, initial, cu_cpu.to(device), cu_cpu)
        torch.cuda.synchronize(device)
        print(json.dumps({"shape": name, "lens": list(lens), "continuing": continuing,
                          "seconds": round(time.perf_counter() - started, 2)}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="qwen3.6-27b,qwen3.6-35b-a3b,train-gpu-deep")
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp16"))
    ap.add_argument("--out", help="also write the table under OUT/fla_configs/")
    ap.add_argument("--no-tree", action="store_true", help="do not write into kernels/triton/fla_configs/")
    args = ap.parse_args()
    if gated_delta.fla_chunk is None:
        raise SystemExit("flash-linear-attention is not importable here: nothing to tune")
    device = torch.device("cuda")
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    for name in args.shapes.split(","):
        run_shape(name, device, dtype)
    chosen = fla_tuned.tuned()
    card = device_name(device)
    table = fla_tuned.merged(table_to_extend(fla_tuned.FOLDER, card), chosen)
    table.setdefault("_about", "fla's autotuner results at the engine's Gated DeltaNet calls "
                     "(scripts/gpu_fla_tune.py); pinned at startup by kernels/triton/fla_tuned.py")
    written = write_table(table, fla_tuned.FOLDER, card, args.out, into_tree=not args.no_tree)
    print(json.dumps({"card": card, "kernels": {k: len(v) for k, v in chosen.items()},
                      "written": [str(p) for p in written]}), flush=True)


if __name__ == "__main__":
    main()
