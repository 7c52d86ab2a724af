"""Sweep the decode attention kernel's key-tile width, warps and key splits (GPU only).

Times 36 back-to-back calls (one per layer of the 8B shape) replayed from a CUDA graph,
for each concurrency and context length, and prints one JSON line per configuration.

    python scripts/gpu_attention_sweep.py --concurrency 1,8 --context 640,4096
"""

from __future__ import annotations

import argparse
import json

import torch

from gpu_timing import bench, graphed  # noqa: E402 (scripts/ is on sys.path)
from ninfer.model.forward_batch import ForwardBatch
from ninfer_kernels.triton import paged_attention as pa

LAYERS, HEADS, KV_HEADS, HEAD_D, PAGE = 36, 32, 8, 128, 16


def decode_batch(c: int, ctx: int, max_ctx: int, dev) -> ForwardBatch:
    per_seq = -(-max_ctx // PAGE)
    tables = torch.arange(c * per_seq, dtype=torch.int32, device=dev).view(c, per_seq)
    slots = tables[:, (ctx - 1) // PAGE].long() * PAGE + (ctx - 1) % PAGE  # each new token's KV slot
    return ForwardBatch(
        query_start=torch.arange(c + 1, dtype=torch.int32, device=dev),
        seq_lens=torch.full((c,), ctx, dtype=torch.int32, device=dev),
        block_tables=tables, slot_mapping=slots,
        logits_indices=torch.arange(c, device=dev), block_size=PAGE, max_query_len=1, max_seq_len=max_ctx,
        query_lens_host=[1] * c, seq_lens_host=[ctx] * c,
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--concurrency", default="1,8")
    ap.add_argument("--context", default="640,4096")
    ap.add_argument("--max-context", type=int, default=8192)
    args = ap.parse_args()
    dev = torch.device("cuda")
    original = pa._tiles
    for c in map(int, args.concurrency.split(",")):
        for ctx in map(int, args.context.split(",")):
            blocks = c * -(-args.max_context // PAGE)
            k = torch.randn(blocks, PAGE, KV_HEADS, HEAD_D, dtype=torch.bfloat16, device=dev)
            v = torch.randn_like(k)
            q = torch.randn(c, HEADS, HEAD_D, dtype=torch.bfloat16, device=dev)
            batch = decode_batch(c, ctx, args.max_context, dev)
            want = pa.paged_attention(q, k, v, batch, HEAD_D**-0.5, num_splits=1)
            default_splits = pa._num_splits(c * KV_HEADS, args.max_context, dev)
            for block_n in (32, 64, 128):
                for warps in (2, 4):
                    pa._tiles = lambda group, mql, bn=block_n, w=warps, **_: (16, 1, bn, w, 2)
                    for splits in (1, 2, 4, 8, 16, 32, 64):
                        got = pa.paged_attention(q, k, v, batch, HEAD_D**-0.5, num_splits=splits)
                        err = float((got.float() - want.float()).abs().max())
                        fn = graphed(lambda s=splits: [pa.paged_attention(q, k, v, batch, HEAD_D**-0.5, num_splits=s)
                                                       for _ in range(LAYERS)])
                        ms = bench(fn, rep=50, warmup=10)
                        print(json.dumps({"concurrency": c, "context": ctx, "block_n": block_n, "warps": warps,
                                          "splits": splits, "us_per_layer": round(ms * 1000 / LAYERS, 2),
                                          "max_err": err, "default_splits": default_splits}), flush=True)
            pa._tiles = original
            orig = graphed(lambda: [pa.paged_attention(q, k, v, batch, HEAD_D**-0.5) for _ in range(LAYERS)])
            print(json.dumps({"concurrency": c, "context": ctx, "current_default": True,
                              "us_per_layer": round(bench(orig, rep=50, warmup=10) * 1000 / LAYERS, 2)}), flush=True)


if __name__ == "__main__":
    main()
