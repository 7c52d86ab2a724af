#!/usr/bin/env python3
"""Sweep the prefill tiles of the paged attention kernel at head dim 256 (GPU only).

One 8192-token prompt in one chunk, causal, page size 16, for the hybrid models' gated
attention shapes (Qwen3.6-27B: 24 q / 4 kv heads; Qwen3.6-35B-A3B: 16 q / 2 kv heads),
replayed from a CUDA graph. The kernel's tiles were tuned on the 8B shape (head dim
128); this says which (BLOCK_M, BLOCK_N, warps, stages) suits 256. One JSON line per
candidate: milliseconds and TFLOP/s (causal: half the square).

    python3 scripts/gpu_prefill_attention_sweep.py --tokens 8192
"""

from __future__ import annotations

import argparse
import json

import torch

from gpu_timing import bench, captured  # noqa: E402 (scripts/ is on sys.path)
from ninfer.model.forward_batch import ForwardBatch
from ninfer_kernels.triton import paged_attention as pa

SHAPES = {"qwen3.6-27b": (24, 4, 256), "qwen3.6-35b-a3b": (16, 2, 256)}
PAGE = 16
#: (BLOCK_M, BLOCK_N, num_warps, num_stages); the first is the tiles the 8B shape chose
CANDIDATES = [(64, 64, 4, 2), (64, 64, 8, 2), (64, 32, 4, 2), (64, 32, 4, 3), (64, 32, 8, 2), (128, 64, 8, 2),
              (128, 32, 8, 2), (128, 64, 8, 1), (64, 64, 4, 1), (128, 32, 8, 3), (64, 128, 8, 1), (128, 128, 8, 1)]


def prefill_batch(tokens: int, dev) -> ForwardBatch:
    pages = -(-tokens // PAGE)
    return ForwardBatch(
        query_start=torch.tensor([0, tokens], dtype=torch.int32, device=dev),
        seq_lens=torch.tensor([tokens], dtype=torch.int32, device=dev),
        block_tables=torch.arange(pages, dtype=torch.int32, device=dev)[None],
        slot_mapping=torch.arange(tokens, device=dev), logits_indices=torch.tensor([tokens - 1], device=dev),
        block_size=PAGE, max_query_len=tokens, max_seq_len=tokens, query_lens_host=[tokens], seq_lens_host=[tokens],
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=8192)
    args = ap.parse_args()
    dev = torch.device("cuda")
    batch = prefill_batch(args.tokens, dev)
    original = pa._tiles
    for name, (heads, kv_heads, dim) in SHAPES.items():
        pages = -(-args.tokens // PAGE)
        q = torch.randn(args.tokens, heads, dim, device=dev, dtype=torch.bfloat16)
        k_cache = torch.randn(pages, PAGE, kv_heads, dim, device=dev, dtype=torch.bfloat16)
        v_cache = torch.randn(pages, PAGE, kv_heads, dim, device=dev, dtype=torch.bfloat16)
        want = None
        flops = 4 * args.tokens * args.tokens / 2 * dim * heads
        for block_m, block_n, warps, stages in CANDIDATES:
            group = heads // kv_heads
            pa._tiles = lambda g, mql, bm=block_m, bn=block_n, w=warps, st=stages, **_: (
                bm, max(1, bm // g), bn, w, st)
            try:
                replay, out = captured(lambda: pa.paged_attention(q, k_cache, v_cache, batch, dim**-0.5))
                ms = bench(replay, rep=30, warmup=5)
            except Exception as exc:  # noqa: BLE001  (out of resources: skip it)
                print(json.dumps({"shape": name, "tiles": [block_m, block_n, warps, stages],
                                  "error": str(exc)[:120]}), flush=True)
                continue
            if want is None:
                want = out.float().clone()
            err = float((out.float() - want).norm() / want.norm())
            print(json.dumps({"shape": name, "group": group, "tiles": [block_m, block_n, warps, stages],
                              "ms": round(ms, 3), "tflop_s": round(flops / ms / 1e9, 1), "diff_vs_first": err}),
                  flush=True)
        pa._tiles = original
        del q, k_cache, v_cache


if __name__ == "__main__":
    main()
