"""Sweep the fused decode attention kernel's launch shape against the unfused ops (GPU only).

For each (concurrency, context) case, times 36 back-to-back layers (``--shape``: the 8B one
by default, 32 query heads, 8 KV heads, head_dim 128; or the hybrid shapes' gated
attention, head_dim 256 with a quarter rotated; page 16) replayed from a CUDA graph: first the three
unfused launches (q/k norm + RoPE, KV write, paged attention with its merge), then the
fused kernel under each warps / stages / key-tile / split setting. One JSON line each.

    python scripts/gpu_decode_attention_sweep.py --cases 1x640,1x4096,8x640,32x640
    python scripts/gpu_decode_attention_sweep.py --shape qwen3.6-35b-a3b --cases 1x768,8x768
"""

from __future__ import annotations

import argparse
import json

import torch

from gpu_attention_sweep import LAYERS, PAGE, decode_batch  # noqa: E402
from gpu_timing import bench, graphed  # noqa: E402 (scripts/ is on sys.path)
from ninfer_kernels import ops
from ninfer_kernels.rope import rope_cos_sin
from ninfer_kernels.triton import decode_attention as da


#: shape -> (query heads, KV heads, head dim, rotary dim)
SHAPES = {"qwen3-8b": (32, 8, 128, 128), "qwen3.6-27b": (24, 4, 256, 64), "qwen3.6-35b-a3b": (16, 2, 256, 64)}


def qkv_views(rows: int, heads: int, kv_heads: int, head_d: int, dev) -> tuple[torch.Tensor, ...]:
    """q, k and v as strided views of one random bf16 projection (as the attention layer
    passes them), and a q/k norm weight."""
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * head_d, dtype=torch.bfloat16, device=dev)
    q = qkv[:, : heads * head_d].view(rows, heads, head_d)
    k = qkv[:, heads * head_d : (heads + kv_heads) * head_d].view(rows, kv_heads, head_d)
    v = qkv[:, (heads + kv_heads) * head_d :].view(rows, kv_heads, head_d)
    return q, k, v, torch.rand(head_d, dtype=torch.bfloat16, device=dev) + 0.5


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-8b", choices=list(SHAPES))
    ap.add_argument("--cases", default="1x640,1x4096,8x640,32x640")
    ap.add_argument("--max-context", type=int, default=40960)
    ap.add_argument("--warps", default="2,4,8")
    ap.add_argument("--stages", default="1,2")
    ap.add_argument("--block-n", default="32,64")
    ap.add_argument("--splits", default="default,4,8,16,32")
    args = ap.parse_args()
    HEADS, KV_HEADS, HEAD_D, ROT = SHAPES[args.shape]
    dev = torch.device("cuda")
    table = rope_cos_sin(args.max_context, ROT, 1_000_000.0, torch.float32, dev)
    for case in args.cases.split(","):
        c, ctx = map(int, case.split("x"))
        batch = decode_batch(c, ctx, args.max_context, dev)
        blocks = int(batch.block_tables.max()) + 1
        k_cache = torch.randn(blocks, PAGE, KV_HEADS, HEAD_D, dtype=torch.bfloat16, device=dev)
        v_cache = torch.randn_like(k_cache)
        q, k, v, w = qkv_views(c, HEADS, KV_HEADS, HEAD_D, dev)
        pos = batch.seq_lens.long() - 1
        scale = HEAD_D**-0.5

        def unfused():
            qr, kr = ops.qk_norm_rope(q, k, w, w, 1e-6, pos, table, ROT)
            ops.write_kv(k_cache, v_cache, kr, v, batch.slot_mapping)
            return ops.paged_attention(qr, k_cache, v_cache, batch, scale)

        want = unfused()
        ms = bench(graphed(lambda: [unfused() for _ in range(LAYERS)]), rep=50, warmup=10)
        print(json.dumps({"shape": args.shape, "concurrency": c, "context": ctx, "kernel": "unfused",
                          "us_per_layer": round(ms * 1000 / LAYERS, 2)}), flush=True)
        for warps in map(int, args.warps.split(",")):
            for stages in map(int, args.stages.split(",")):
                for block_n in map(int, args.block_n.split(",")):
                    for splits in [int(x) if x != "default" else None for x in args.splits.split(",")]:
                        da.LAUNCH_SHAPES[HEAD_D] = (warps, stages, block_n, block_n, 1)

                        def fused(s=splits):
                            return da.decode_attention(q, k, v, w, w, 1e-6, pos, table, ROT, k_cache, v_cache,
                                                       batch, scale, num_splits=s)

                        err = float((fused().float() - want.float()).abs().max())
                        ms = bench(graphed(lambda: [fused() for _ in range(LAYERS)]), rep=50, warmup=10)
                        print(json.dumps({"shape": args.shape, "concurrency": c, "context": ctx, "kernel": "fused", "warps": warps,
                                          "stages": stages, "block_n": block_n, "splits": splits or "default",
                                          "us_per_layer": round(ms * 1000 / LAYERS, 2), "max_err": err}),
                              flush=True)


if __name__ == "__main__":
    main()
