"""Where the device time of one decode step goes (GPU only).

Builds a Qwen3-shaped model with random weights straight on the device (no checkpoint),
captures the decode graphs and, per concurrency, prints one JSON line: the replayed
forward's time, the LM head's and the sampler's, and the step's kernels grouped by name
(device microseconds per step, launches per step), from the torch profiler.

    python scripts/gpu_decode_profile.py --shape qwen3-8b --concurrency 1,8 --context 640
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from ninfer.bench.bandwidth import cuda_ms
from ninfer.model.random_weights import SHAPES
from ninfer.engine.cuda_graph import DecodeGraphs
from ninfer.engine.gemm_setup import prefer_matmuls_without_workspace
from ninfer.plugins import load_registry
from ninfer_plugins.models.decoder import build_decoder
from ninfer_plugins.models.layers import store_linears_column_major

BLOCK = 16


def random_model(shape: str, device: torch.device):
    model = build_decoder(SHAPES[shape], torch.bfloat16, device)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02)
    store_linears_column_major(model)  # as load_weights leaves them on CUDA
    return model


def decode_setup(shape: str, max_batch: int, max_context: int, device: torch.device):
    """A random model of ``shape`` with bf16 KV pages for ``max_batch`` sequences of up to
    ``max_context`` tokens (sequence ``i`` owns pages ``i * blocks_per_seq`` onwards), set
    up as the engine would run it; returns (model, blocks_per_seq)."""
    prefer_matmuls_without_workspace(device)  # as the engine builder does
    torch.manual_seed(0)
    model = random_model(shape, device)
    kv = load_registry().get("kv_dtype", "bf16")
    blocks_per_seq = -(-max_context // BLOCK)
    caches = [kv.allocate(blocks_per_seq * max_batch + 1, BLOCK, s.num_kv_heads, s.head_dim, torch.bfloat16, device)
              for s in model.attention_specs()]
    model.bind_kv_caches(caches)
    return model, blocks_per_seq


def kernel_table(fn, steps: int) -> tuple[list[dict], float, int]:
    """Kernels grouped by name, plus summed kernel microseconds and launches per call."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    total: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)
    for evt in prof.events():
        if evt.device_type == torch.autograd.DeviceType.CUDA:
            total[evt.name] += evt.device_time
            count[evt.name] += 1
    rows = [
        {"kernel": name[:90], "us_per_step": round(us / steps, 1), "launches_per_step": count[name] / steps}
        for name, us in total.items()
    ]
    busy = sum(total.values()) / steps
    return sorted(rows, key=lambda r: -r["us_per_step"]), busy, sum(count.values()) // steps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-8b")
    ap.add_argument("--concurrency", default="1,8")
    ap.add_argument("--context", type=int, default=640)
    args = ap.parse_args()
    dev = torch.device("cuda")
    levels = [int(c) for c in args.concurrency.split(",")]
    max_batch, max_context = max(levels), args.context + 64
    model, blocks_per_seq = decode_setup(args.shape, max_batch, max_context, dev)
    graphs = DecodeGraphs(model, max_batch, max_context, BLOCK, dev)
    graphs.capture()
    vocab = SHAPES[args.shape]["vocab_size"]
    for c in levels:
        tables = [list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)) for i in range(c)]
        hidden = graphs.run([1] * c, [args.context] * c, tables)
        bucket = graphs.bucket_for(c)
        replay = cuda_ms(lambda: graphs.replay(bucket), 50, warmup=5)
        head = cuda_ms(lambda: model.compute_logits(hidden), 50, warmup=5)
        logits = model.compute_logits(hidden)
        argmax = cuda_ms(lambda: logits.argmax(-1), 50, warmup=5)
        table, busy, launches = kernel_table(lambda: graphs.replay(bucket), 10)
        record = {
            "shape": args.shape, "concurrency": c, "context": args.context, "vocab": vocab,
            "graph_replay_ms": round(replay, 4), "graph_head": graphs.has_head(bucket),
            "lm_head_ms": round(head, 4), "argmax_ms": round(argmax, 4),
            # replay time not covered by any kernel: launch gaps between dependent kernels
            "kernel_busy_ms": round(busy / 1000, 4), "kernels_per_replay": launches,
            "graph_kernels": table[:30],
        }
        print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main()
