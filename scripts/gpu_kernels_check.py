#!/usr/bin/env python3
"""Check every Triton kernel against its reference at Qwen3-8B shapes on one CUDA GPU.

For each case: relative error ||out - ref|| / ||ref||, median times from
``triton.testing.do_bench`` (L2 flushed between runs), and the bytes the kernel must
move over its time, against a measured device-to-device copy. Kernel times are CUDA
graph replays, so they hold device time only (decode runs from graphs too); the eager
call, Python launch cost included, is reported beside them, and so is the reference.
One JSON object per line goes to ``--out``; a table goes to stdout.

    python3 scripts/gpu_kernels_check.py --out kernels.jsonl
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from typing import Callable

import torch

from gpu_timing import bench, graphed, rel_err  # noqa: E402 (scripts/ is on sys.path)
from ninfer.model.forward_batch import ForwardBatch
from ninfer_kernels import activation, attention, norm, rope
from ninfer_kernels.triton import activation as t_activation
from ninfer_kernels.triton import kv_write as t_kv_write
from ninfer_kernels.triton import norm as t_norm
from ninfer_kernels.triton import paged_attention as t_attention
from ninfer_kernels.triton import rope as t_rope

HEADS, KV_HEADS, HEAD_DIM, HIDDEN, INTERMEDIATE, PAGE = 32, 8, 128, 4096, 12288, 16
DTYPE = torch.bfloat16
MAX_REL_ERR = 1e-2  # bf16 operands: errors land between 1e-3 and 1e-2


def bench_kernel(fn: Callable[[], object]) -> tuple[float, dict]:
    """(device ms from graph replays, {"eager_us": eager call time})."""
    return bench(graphed(fn)), {"eager_us": bench(fn) * 1e3}


class Report:
    def __init__(self, path: str, copy_gbps: float):
        self.file = open(path, "w")
        self.copy_gbps = copy_gbps
        self.failed = 0

    def add(self, kernel: str, case: str, err: float, ms: float, ref_ms: float | None, nbytes: float, **extra) -> None:
        gbps = nbytes / ms / 1e6
        row = {
            "kernel": kernel, "case": case, "rel_err": err, "ms": ms, "ref_ms": ref_ms,
            "bytes": nbytes, "gbps": gbps, "bw_frac": gbps / self.copy_gbps,
            "ok": err <= MAX_REL_ERR, **extra,
        }
        self.failed += not row["ok"]
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()
        speedup = f"{ref_ms / ms:7.1f}x" if ref_ms else "      -"
        more = " ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in extra.items())
        print(f"{kernel:15s} {case:27s} err={err:7.1e} {ms * 1e3:8.1f}us ref {speedup} "
              f"{gbps:7.0f}GB/s {100 * row['bw_frac']:5.1f}% {'ok' if row['ok'] else 'FAIL'} {more}", flush=True)


def copy_bandwidth() -> float:
    """GB/s of a large device-to-device copy, bytes read plus bytes written."""
    src = torch.randn(2**29, device="cuda", dtype=DTYPE)  # 1 GiB
    dst = torch.empty_like(src)
    ms = bench(lambda: dst.copy_(src))
    return 2 * src.nbytes / ms / 1e6


# -- paged attention ---------------------------------------------------------------------


def make_batch(specs: list[tuple[int, int]], gen: torch.Generator) -> tuple[ForwardBatch, int]:
    """Sequences as (cached prefix, new tokens), pages shuffled over the whole cache."""
    seq_lens = [p + n for p, n in specs]
    pages = [math.ceil(s / PAGE) for s in seq_lens]
    num_blocks = sum(pages) + 64
    ids = torch.randperm(num_blocks, generator=gen)
    tables = torch.zeros(len(specs), max(pages), dtype=torch.int32)
    used = 0
    for i, n in enumerate(pages):
        tables[i, :n] = ids[used : used + n]
        used += n
    q_lens = [n for _, n in specs]
    batch = ForwardBatch(
        query_start=torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda"),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device="cuda"),
        block_tables=tables.cuda(),
        slot_mapping=torch.zeros(sum(q_lens), dtype=torch.int64, device="cuda"),  # unused here
        logits_indices=torch.zeros(len(specs), dtype=torch.int64, device="cuda"),
        block_size=PAGE, max_query_len=max(q_lens), max_seq_len=max(seq_lens),
        query_lens_host=q_lens, seq_lens_host=seq_lens,
    )
    return batch, num_blocks


def check_attention(report: Report, case: str, specs: list[tuple[int, int]], gen: torch.Generator) -> None:
    batch, num_blocks = make_batch(specs, gen)
    shape = (num_blocks, PAGE, KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(shape, device="cuda", dtype=DTYPE)
    v_cache = torch.randn(shape, device="cuda", dtype=DTYPE)
    q = torch.randn(sum(n for _, n in specs), HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
    scale = HEAD_DIM**-0.5
    fn = lambda splits=None: t_attention.paged_attention(q, k_cache, v_cache, batch, scale, num_splits=splits)  # noqa: E731
    err = rel_err(fn(), attention.paged_attention(q, k_cache, v_cache, batch, scale))
    ms, extra = bench_kernel(fn)
    ref_ms = bench(lambda: attention.paged_attention(q, k_cache, v_cache, batch, scale), rep=30)
    context = sum(p + n for p, n in specs)
    nbytes = 2 * context * KV_HEADS * HEAD_DIM * DTYPE.itemsize + 2 * q.nbytes
    # Each row attends to its position + 1 keys: QK^T and PV, 2 FLOPs per multiply-add.
    visible = sum(n * p + n * (n + 1) // 2 for p, n in specs)
    extra["tflops"] = 4 * HEADS * HEAD_DIM * visible / ms / 1e9
    blocks = math.ceil(batch.max_query_len / t_attention._tiles(HEADS // KV_HEADS, batch.max_query_len)[1])
    splits = t_attention._num_splits(blocks * len(specs) * KV_HEADS, batch.max_seq_len, q.device)
    extra["splits"] = splits
    if splits > 1:
        extra["nosplit_us"] = bench(graphed(lambda: fn(1))) * 1e3
    report.add("paged_attention", case, err, ms, ref_ms, nbytes, **extra)


def check_attention_graph(report: Report, gen: torch.Generator) -> None:
    """Capture a decode step in a CUDA graph, change lengths and tables on the device, replay."""
    batch, num_blocks = make_batch([(2000, 1)] * 8, gen)
    k_cache = torch.randn(num_blocks, PAGE, KV_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
    v_cache = torch.randn_like(k_cache)
    q = torch.randn(8, HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
    t_attention.paged_attention(q, k_cache, v_cache, batch, 0.1)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = t_attention.paged_attention(q, k_cache, v_cache, batch, 0.1)
    new_lens = torch.randint(1, 2001, (8,), generator=gen, dtype=torch.int32)
    batch.seq_lens.copy_(new_lens)
    batch.block_tables.copy_(batch.block_tables.flip(0))
    q.normal_()
    graph.replay()
    batch.seq_lens_host = new_lens.tolist()
    err = rel_err(out, attention.paged_attention(q, k_cache, v_cache, batch, 0.1))
    ms = bench(graph.replay)
    report.add("paged_attention", "cuda_graph_replay_b8", err, ms, None, 2 * sum(batch.seq_lens_host) * KV_HEADS * HEAD_DIM * 2 * DTYPE.itemsize)


# -- the small kernels --------------------------------------------------------------------


def check_small(report: Report, tokens: int, gen: torch.Generator) -> None:
    qkv = torch.randn(tokens, (HEADS + 2 * KV_HEADS) * HEAD_DIM, device="cuda", dtype=DTYPE)
    q = qkv[:, : HEADS * HEAD_DIM].view(tokens, HEADS, HEAD_DIM)
    k = qkv[:, HEADS * HEAD_DIM : (HEADS + KV_HEADS) * HEAD_DIM].view(tokens, KV_HEADS, HEAD_DIM)
    v = qkv[:, (HEADS + KV_HEADS) * HEAD_DIM :].view(tokens, KV_HEADS, HEAD_DIM)
    case = f"T={tokens}"

    def add(kernel: str, label: str, err: float, fn: Callable, ref: Callable, nbytes: float, **more) -> None:
        ms, extra = bench_kernel(fn)
        report.add(kernel, label, err, ms, bench(ref), nbytes, **extra, **more)

    x = torch.randn(tokens, HIDDEN, device="cuda", dtype=DTYPE)
    res = torch.randn_like(x)
    w = torch.rand(HIDDEN, device="cuda", dtype=DTYPE) + 0.5
    add("rms_norm", case, rel_err(t_norm.rms_norm(x, w, 1e-6), norm.rms_norm(x, w, 1e-6)),
        lambda: t_norm.rms_norm(x, w, 1e-6), lambda: norm.rms_norm(x, w, 1e-6), 2 * x.nbytes)
    (out, new_res), (ref_out, ref_res) = t_norm.rms_norm(x, w, 1e-6, res), norm.rms_norm(x, w, 1e-6, res)
    add("rms_norm", case + " +residual", max(rel_err(out, ref_out), rel_err(new_res, ref_res)),
        lambda: t_norm.rms_norm(x, w, 1e-6, res), lambda: norm.rms_norm(x, w, 1e-6, res), 4 * x.nbytes,
        residual_bit_equal=bool(torch.equal(new_res, ref_res)))
    wh = torch.rand(HEAD_DIM, device="cuda", dtype=DTYPE) + 0.5
    add("rms_norm", case + " per-head q", rel_err(t_norm.rms_norm(q, wh, 1e-6), norm.rms_norm(q, wh, 1e-6)),
        lambda: t_norm.rms_norm(q, wh, 1e-6), lambda: norm.rms_norm(q, wh, 1e-6), 2 * q.numel() * 2)

    table = rope.rope_cos_sin(40960, HEAD_DIM, 1_000_000.0, torch.float32, "cuda")
    pos = torch.randint(0, 40960, (tokens,), generator=gen).cuda()
    got, want = t_rope.apply_rope(q, k, pos, table, HEAD_DIM), rope.apply_rope(q, k, pos, table, HEAD_DIM)
    add("apply_rope", case, max(rel_err(got[0], want[0]), rel_err(got[1], want[1])),
        lambda: t_rope.apply_rope(q, k, pos, table, HEAD_DIM), lambda: rope.apply_rope(q, k, pos, table, HEAD_DIM),
        2 * (q.numel() + k.numel()) * 2)

    gate_up = torch.randn(tokens, 2 * INTERMEDIATE, device="cuda", dtype=DTYPE)
    add("silu_and_mul", case, rel_err(t_activation.silu_and_mul(gate_up), activation.silu_and_mul(gate_up)),
        lambda: t_activation.silu_and_mul(gate_up), lambda: activation.silu_and_mul(gate_up), 1.5 * gate_up.nbytes)

    num_blocks = max(64, 4 * tokens // PAGE)
    slots = torch.randperm(num_blocks * PAGE, generator=gen)[:tokens].cuda()
    slots[::7] = -1  # padding rows
    caches = [torch.randn(num_blocks, PAGE, KV_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE) for _ in range(2)]
    ref_caches = [c.clone() for c in caches]
    t_kv_write.write_kv(*caches, k, v, slots)
    attention.write_kv(*ref_caches, k, v, slots)
    err = max(rel_err(caches[0], ref_caches[0]), rel_err(caches[1], ref_caches[1]))
    add("write_kv", case, err, lambda: t_kv_write.write_kv(*caches, k, v, slots),
        lambda: attention.write_kv(*ref_caches, k, v, slots), 4 * k.numel() * 2,
        bit_equal=bool(torch.equal(caches[0], ref_caches[0]) and torch.equal(caches[1], ref_caches[1])))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON-lines file to write")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    started = time.perf_counter()
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    report = Report(args.out, copy_bandwidth())
    print(f"{torch.cuda.get_device_name()}: copy {report.copy_gbps:.0f} GB/s (read + write)", flush=True)

    for tokens in (64, 8192):
        check_small(report, tokens, gen)
    for batch in (1, 8, 32, 64):
        for context in (512, 2048, 8192):
            check_attention(report, f"decode b={batch} ctx={context}", [(context - 1, 1)] * batch, gen)
    ragged = [(int(n) - 1, 1) for n in torch.randint(512, 8193, (32,), generator=gen)]
    check_attention(report, "decode b=32 ctx=512..8k", ragged, gen)
    check_attention(report, "prefill 2k", [(0, 2048)], gen)
    check_attention(report, "prefill 8k", [(0, 8192)], gen)
    check_attention(report, "chunk 2k on 6k prefix", [(6144, 2048)], gen)
    check_attention(report, "mixed 2k chunk + 31 decode", [(0, 2048)] + [(4095, 1)] * 31, gen)
    check_attention_graph(report, gen)
    torch.cuda.synchronize()
    print(f"{report.failed} failed; {time.perf_counter() - started:.0f} s", flush=True)
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
