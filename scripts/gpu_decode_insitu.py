"""What each small kernel really costs inside a replayed decode step (GPU only).

A kernel's duration in a profile overstates its cost under programmatic dependent
launch (it starts early and waits), and microbenchmarks read their inputs from L2. This
script instead times the whole replayed graph of a Qwen3-shaped random model, then
re-captures it with one op swapped: a launch-free stand-in (``skip:OP``: the step's time
without that kernel; the numbers it computes are garbage), another copy of the op's
kernel module (``impl:OP=FILE``, e.g. the last commit's, for an A/B in one process) or
the decode attention kernel with other launch settings. Variants are interleaved over
the repeats. One JSON line per variant, batch size and context length.

    python scripts/gpu_decode_insitu.py --concurrency 1,8 --context 640,4096 \
        --variants ",skip:decode_attention,block_n:64"   # "": the code as it is
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.util
import json
import os

import torch

from gpu_decode_profile import BLOCK, decode_setup  # noqa: E402 (scripts/ is on sys.path)
from ninfer.bench.bandwidth import cuda_ms
from ninfer.engine.cuda_graph import DecodeGraphs
from ninfer_kernels import ops
from ninfer_kernels.triton import decode_attention as fused


def _skip_norm(x, weight, eps, residual=None, expert_rows=False):
    if expert_rows:  # a MoE layer's rows, which the norm sums
        x = x.sum(dim=-2)
    return x if residual is None else (x, x)


def _skip_silu(x):
    return x[..., : x.shape[-1] // 2]


def _skip_attention(q, *args):
    return q


SKIPS = {"rms_norm": _skip_norm, "silu_and_mul": _skip_silu, "decode_attention": _skip_attention}


def _module_from(path: str):
    spec = importlib.util.spec_from_file_location(f"insitu_{abs(hash(path))}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def variant(name: str):
    """Swap in one op implementation or launch setting for the duration of a capture."""
    impls = ops.IMPLEMENTATIONS
    saved = {op: dict(v) for op, v in impls.items()}
    saved_shapes, saved_splits = dict(fused.LAUNCH_SHAPES), fused.MAX_SPLITS
    saved_pdl = os.environ.get("NINFER_PDL")
    try:
        for part in filter(None, name.split("+")):
            key, _, value = part.partition(":")
            if key == "skip":
                impls[value]["triton"] = SKIPS[value]
            elif key == "splits":
                impls["decode_attention"]["triton"] = functools.partial(fused.decode_attention,
                                                                        num_splits=int(value))
            elif key in ("warps", "stages", "block_n"):  # block_n: one key tile, whatever the split count
                for dim, (warps, stages, block_n, small, small_splits) in list(fused.LAUNCH_SHAPES.items()):
                    warps, stages = (int(value) if key == "warps" else warps), (int(value) if key == "stages" else stages)
                    block_n, small = (int(value), int(value)) if key == "block_n" else (block_n, small)
                    fused.LAUNCH_SHAPES[dim] = (warps, stages, block_n, small, small_splits)
            elif key == "max_splits":  # the split heuristic's cap
                fused.MAX_SPLITS = int(value)
            elif key == "impl":  # impl:OP=FILE.py: OP from another copy of its kernel module
                op, _, path = value.partition("=")
                impls[op]["triton"] = getattr(_module_from(path), op)
            elif key == "pdl":
                os.environ["NINFER_PDL"] = value
            else:
                raise ValueError(f"unknown variant part {part!r}")
        yield
    finally:
        for op, v in saved.items():
            impls[op].update(v)
        fused.LAUNCH_SHAPES.clear()
        fused.LAUNCH_SHAPES.update(saved_shapes)
        fused.MAX_SPLITS = saved_splits
        if saved_pdl is None:
            os.environ.pop("NINFER_PDL", None)
        else:
            os.environ["NINFER_PDL"] = saved_pdl


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-8b")
    ap.add_argument("--concurrency", default="1,8")
    ap.add_argument("--context", default="640", help="context lengths, comma-separated")
    ap.add_argument("--max-context", type=int, default=8192, help="what the graphs size key splits for")
    ap.add_argument("--variants", default=",skip:decode_attention,skip:rms_norm,skip:silu_and_mul,"
                    "skip:decode_attention+skip:rms_norm+skip:silu_and_mul,pdl:0,warps:4,splits:8,splits:4")
    ap.add_argument("--repeats", type=int, default=3, help="captures per variant (the median is kept)")
    args = ap.parse_args()
    dev = torch.device("cuda")
    levels = [int(c) for c in args.concurrency.split(",")]
    max_batch = max(levels)
    model, blocks_per_seq = decode_setup(args.shape, max_batch, args.max_context, dev)
    names = args.variants.split(",")
    contexts = [int(n) for n in args.context.split(",")]
    times = {(name, c, n): [] for name in names for c in levels for n in contexts}
    for _ in range(args.repeats):  # variants interleaved, so drift hits them alike
        for name in names:
            with variant(name):
                graphs = DecodeGraphs(model, max_batch, args.max_context, BLOCK, dev)
                graphs.capture()
            for c in levels:
                for n in contexts:
                    tables = [list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)) for i in range(c)]
                    bucket = graphs.stage_inputs([1] * c, [n] * c, tables)
                    times[name, c, n].append(cuda_ms(lambda: graphs.replay(bucket), 100, warmup=10))
            del graphs
            torch.cuda.empty_cache()
    for (name, c, n), runs in times.items():
        print(json.dumps({"variant": name or "as shipped", "concurrency": c, "context": n,
                          "replay_ms": round(sorted(runs)[len(runs) // 2], 4),
                          "all_ms": [round(t, 4) for t in runs]}), flush=True)


if __name__ == "__main__":
    main()
