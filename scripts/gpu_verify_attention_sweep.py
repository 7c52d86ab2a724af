"""Decode attention with one row a sequence against speculative verify rows (GPU only).

Session 35's round profile on ``random:train-gpu-deep`` (H100, c=1, k=3) put the fused
kernel at 29 us a launch with four rows a sequence against 10 us with one: 318 us of a
1,403 us round. This times the kernel alone, per shape and context, in CUDA graphs of
``--layers`` back-to-back launches, with the launch shape the engine picks and then
each (splits, warps, key tile) of the sweep; the unfused path (norm + RoPE, KV write,
paged attention and its merge) is the peer. ``--max-context`` is what a captured graph
sizes its splits for (the engine's max context), ``context`` what the sequence holds.
Each row is checked against the unfused output. One JSON line each.

    python scripts/gpu_verify_attention_sweep.py --shapes train-gpu-deep --cases 1x400,4x400 \\
        --max-context 3072
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch

from gpu_decode_attention_sweep import qkv_views  # noqa: E402 (scripts/ is on sys.path)
from gpu_timing import bench, graphed  # noqa: E402
from ninfer.model.forward_batch import ForwardBatch
from ninfer_kernels import ops
from ninfer_kernels.rope import rope_cos_sin
from ninfer_kernels.triton import decode_attention as da

PAGE = 16
#: shape -> (query heads, KV heads, head dim, rotary dim)
SHAPES = {"train-gpu-deep": (4, 2, 128, 32), "qwen3.6-27b": (24, 4, 256, 64), "qwen3-8b": (32, 8, 128, 128)}


def verify_batch(rows: int, ctx: int, max_ctx: int, dev) -> tuple[ForwardBatch, torch.Tensor]:
    """One sequence whose last ``rows`` of ``ctx`` tokens are new (a verify row at rows > 1)."""
    pages = -(-max_ctx // PAGE)
    table = torch.arange(pages, dtype=torch.int32, device=dev)[None]
    pos = torch.arange(ctx - rows, ctx, device=dev)
    slots = table[0, pos // PAGE].long() * PAGE + pos % PAGE
    batch = ForwardBatch(
        query_start=torch.tensor([0, rows], dtype=torch.int32, device=dev),
        seq_lens=torch.tensor([ctx], dtype=torch.int32, device=dev), block_tables=table, slot_mapping=slots,
        logits_indices=torch.arange(rows, device=dev), block_size=PAGE, max_query_len=rows, max_seq_len=max_ctx,
        query_lens_host=[rows], seq_lens_host=[ctx], rows_per_seq=rows,
    )
    return batch, pos


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="train-gpu-deep,qwen3.6-27b")
    ap.add_argument("--cases", default="1x400,4x400,1x4096,4x4096", help="rows x context, comma-separated")
    ap.add_argument("--max-context", type=int, default=3072)
    ap.add_argument("--layers", type=int, default=16, help="launches a graph replays back to back")
    ap.add_argument("--splits", default="2,4,8,32")
    ap.add_argument("--warps", default="4,8")
    ap.add_argument("--block-n", default="32,64")
    ap.add_argument("--check-only", action="store_true",
                    help="errors only, no timing (on the CPU: NINFER_KERNELS=triton TRITON_INTERPRET=1)")
    args = ap.parse_args()
    dev = torch.device("cpu" if args.check_only and not torch.cuda.is_available() else "cuda")
    torch.manual_seed(0)
    for shape in args.shapes.split(","):
        heads, kv_heads, head_d, rot = SHAPES[shape]
        table = rope_cos_sin(max(args.max_context, 8192), rot, 1_000_000.0, torch.float32, dev)
        for case in args.cases.split(","):
            rows, ctx = map(int, case.split("x"))
            max_ctx = max(args.max_context, ctx)
            batch, pos = verify_batch(rows, ctx, max_ctx, dev)
            k_cache = torch.randn(-(-max_ctx // PAGE), PAGE, kv_heads, head_d, dtype=torch.bfloat16, device=dev)
            v_cache = torch.randn_like(k_cache)
            q, k, v, w = qkv_views(rows, heads, kv_heads, head_d, dev)
            scale = head_d**-0.5
            common = {"shape": shape, "rows": rows, "context": ctx, "max_context": max_ctx}

            def unfused():
                qr, kr = ops.qk_norm_rope(q, k, w, w, 1e-6, pos, table, rot)
                ops.write_kv(k_cache, v_cache, kr, v, batch.slot_mapping)
                return ops.paged_attention(qr, k_cache, v_cache, batch, scale)

            want = unfused().float()

            def timed(fn) -> float | None:
                if args.check_only:
                    return None
                return round(bench(graphed(lambda: [fn() for _ in range(args.layers)]), rep=50, warmup=10)
                             * 1000 / args.layers, 2)

            print(json.dumps({**common, "kernel": "unfused", "us": timed(unfused)}), flush=True)
            default = da.LAUNCH_SHAPES[head_d]

            def fused(splits=None):
                return da.decode_attention(q, k, v, w, w, 1e-6, pos, table, rot, k_cache, v_cache, batch, scale,
                                           num_splits=splits)

            err = float((fused().float() - want).abs().max())
            print(json.dumps({**common, "kernel": "fused", "launch": "engine's", "us": timed(fused),
                              "max_err": err}), flush=True)
            for splits, warps, block_n in itertools.product(
                    map(int, args.splits.split(",")), map(int, args.warps.split(",")),
                    map(int, args.block_n.split(","))):
                # the kernel raises its warps for several rows a sequence: a smaller ask shows as the raised one
                da.LAUNCH_SHAPES[head_d] = (warps, default[1], block_n, block_n, 1)
                try:
                    err = float((fused(splits).float() - want).abs().max())
                    us = timed(lambda: fused(splits))
                except Exception as exc:  # a shape that does not fit (shared memory): say so, go on
                    print(json.dumps({**common, "kernel": "fused", "splits": splits, "warps": warps,
                                      "block_n": block_n, "error": repr(exc)[:200]}), flush=True)
                    continue
                finally:
                    da.LAUNCH_SHAPES[head_d] = default
                print(json.dumps({**common, "kernel": "fused", "splits": splits, "warps": warps, "block_n": block_n,
                                  "us": us, "max_err": err}), flush=True)


if __name__ == "__main__":
    main()
