#!/usr/bin/env python3
"""Time the quantized-weight kernels against bf16 cuBLAS, and tune their launch shapes.

1. ``linear``: every projection of Qwen3.6-27B and Qwen3.6-35B-A3B (from the models built
   on the meta device; routers and gates aside), at 1..8192 rows: bf16 ``F.linear`` on the
   weight as the engine stores it, against ``quant_linear`` in FP8 (128x128 blocks; both
   FP8 paths from 16 rows on), int4 (group 128) and NVFP4 with their table/heuristic
   shapes. One JSON line each: microseconds, the weight's bytes (scales included) per
   second, that as a share of this card's copy bandwidth, the speed-up over bf16, and the
   error against the dequantized weight in float32 (at 1 and 512 rows).
2. ``moe``: the 35B-A3B's experts (256 + a shared one, top 8, I=512) in each format
   against bf16, at 1..4096 tokens.
3. ``tune`` (until ``--budget-s`` is spent): the 27B shapes at the decode row counts, and
   at prefill sizes our tiles against the cuBLAS routes (dequantized weight, block-scaled
   FP8), over a few candidates (the heuristic's among them; ``--jobs fp8:1,int4:8192``
   limits it to those); the winners are merged into
   ``quant_configs/<device>.json`` (entries not re-tuned keep theirs), written to
   ``--out-dir`` (and into the source tree with ``--write``).

Each timing replays a CUDA graph of back-to-back calls, each on its own copy of the weight
(well past the L2 in all), as a decode step runs them. JSON lines on stdout.

    python3 scripts/gpu_quant_gemm_sweep.py --parts linear,moe,tune --budget-s 150 --out-dir "$OUT"
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import torch
import torch.nn.functional as F
from gpu_skinny_sweep import linear_shapes, routing  # noqa: E402 (scripts/ is on sys.path)
from gpu_timing import bench, captured, copy_bytes_per_s, rel_err  # noqa: E402
from quant_candidates import decode_candidates, gemv_candidates, prefill_candidates  # noqa: E402

from ninfer_kernels import quant_formats as qf
from ninfer_kernels.triton import fused_moe as t_fused
from ninfer_kernels.triton import cublas_prefill as cp
from ninfer_kernels.triton import quant_gemm as qg
from ninfer_kernels.triton import quant_launch as ql
from ninfer_kernels.triton.quant_tiles import FP8
from ninfer_kernels.triton.tuned_tables import table_to_extend, write_table

DTYPE = torch.bfloat16
MODELS = ("qwen3.6-27b", "qwen3.6-35b-a3b")
ROWS = (1, 2, 4, 8, 16, 32, 64, 512, 8192)
FORMATS = ("fp8", "int4", "nvfp4")
ROTATION_BYTES = 400 << 20
MAX_COPIES = 32
TUNE_ROWS = (1, 4, 16, 64)
PREFILL_TUNE_ROWS = (1024, 8192)  # the default prefill chunk, and a long one
#: (name, routed experts, hidden, expert intermediate, top_k) with a shared expert
MOE = ("qwen3.6-35b-a3b", 256, 2048, 512, 8)
MOE_TOKENS = (1, 8, 64, 512, 4096)


def emit(row: dict) -> None:
    print(json.dumps(row), flush=True)


def random_weight(fmt: str, *shape: int, gen: torch.Generator):
    """Codes and scales in ``fmt`` for a [.., N, K] weight with entries of about K**-0.5."""
    *lead, n, k = shape
    lead = tuple(lead)
    dev = "cuda"
    if fmt == "fp8":
        codes = (torch.randn(*lead, n, k, generator=gen, device=dev) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
        scale = (torch.rand((*lead, -(-n // 128), -(-k // 128)), generator=gen, device=dev) + 0.5) / (64 * k**0.5)
        return qf.Fp8Block(codes, scale, (128, 128))
    if fmt == "int4":
        words = torch.randint(-2**31, 2**31 - 1, (*lead, n, k // 8), generator=gen, device=dev, dtype=torch.int64)
        scales = ((torch.rand((*lead, n, k // 128), generator=gen, device=dev) + 0.5) / (4.6 * k**0.5)).to(DTYPE)
        # symmetric (zero points all 8), as GPTQ's and compressed-tensors' published int4 and
        # the bench's random:...@gptq are: their kernels read no zero points
        zeros = torch.full((*lead, n, k // 128), 8.0, device=dev, dtype=DTYPE)
        return qf.Int4Group(words.to(torch.int32), scales, zeros, 128, symmetric=True)
    packed = torch.randint(0, 256, (*lead, n, k // 2), generator=gen, device=dev, dtype=torch.int32)
    scale = (torch.rand((*lead, n, k // 16), generator=gen, device=dev) * 3 + 0.5).to(torch.float8_e4m3fn)
    return qf.Nvfp4(packed.to(torch.uint8), scale, (torch.rand(lead, generator=gen, device=dev) + 0.5) / (8 * k**0.5))


def nbytes(w) -> int:
    if isinstance(w, torch.Tensor):
        return w.numel() * w.element_size()
    return sum(t.numel() * t.element_size() for t in vars(w).values() if isinstance(t, torch.Tensor))


def time_us(calls) -> float:
    """Microseconds per call of ``calls`` (closures) replayed from one graph."""
    replay, _ = captured(lambda: [c() for c in calls])
    return bench(replay, rep=20, warmup=5) * 1e3 / len(calls)


def copies_for(weight_bytes: int, rows: int) -> int:
    """Enough copies to read past the L2 at decode sizes; two where the math dominates."""
    return 2 if rows > 64 else max(2, min(MAX_COPIES, ROTATION_BYTES // weight_bytes))


def all_linear_shapes() -> dict[tuple[int, int], str]:
    """The quantized products of each model's checkpoints: fused layers' dense rows apart
    (the 27B's in_proj runs 16,384 quantized rows, not 16,480: :func:`linear_shapes`)."""
    shapes: dict[tuple[int, int], str] = {}
    for model in MODELS:
        for (n, k), name in linear_shapes(model, segments=True).items():
            if n > 512 and not name.endswith("[dense]"):  # routers and gates stay bf16
                shapes.setdefault((n, k), f"{model}:{name}")
    return shapes


def report_linear(deadline: float) -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    sms = qg.sm_count(torch.device("cuda"))
    for (n, k), name in all_linear_shapes().items():
        bf16 = [(torch.randn(n, k, device="cuda", dtype=DTYPE) * k**-0.5).t().contiguous().t()
                for _ in range(copies_for(n * k * 2, 1))]
        base = {}
        for rows in ROWS:
            x = torch.randn(rows, k, device="cuda", dtype=DTYPE)
            ws = bf16[:copies_for(n * k * 2, rows)]
            base[rows] = time_us([lambda w=w: F.linear(x, w) for w in ws])
            emit({"linear": name, "n": n, "k": k, "rows": rows, "format": "bf16", "us": round(base[rows], 2),
                  "gb_s": round(n * k * 2 / base[rows] / 1e3), "pct_copy_bw": pct(n * k * 2, base[rows])})
        del bf16
        for fmt in FORMATS:
            weights = [random_weight(fmt, n, k, gen=gen)]
            wb = nbytes(weights[0])
            weights += [random_weight(fmt, n, k, gen=gen) for _ in range(copies_for(wb, 1) - 1)]
            dense = weights[0].dequantize()
            for rows in ROWS:
                if time.time() > deadline:
                    emit({"linear": name, "skipped": "budget"})
                    return
                x = torch.randn(rows, k, device="cuda", dtype=DTYPE)
                ws = weights[:copies_for(wb, rows)]
                picked = qg.choose_config(x, qg.operands(ws[0]))
                variants = [("", picked)]
                if fmt == "fp8" and rows >= 16:  # the other FP8 path too: weight-only or tensor-core
                    other = qg.heuristic_config(FP8, min(rows, 64) if picked.act_quant else 4096, n, k, sms)
                    variants.append(("_tc" if other.act_quant else "_wo", other))
                if fmt != "nvfp4" and rows <= 4 and not picked.gemv:  # the no-tl.dot kernel
                    variants.append(("_gemv", gemv_candidates(rows, n, k, sms)[0]))
                for suffix, cfg in variants:
                    us = time_us([lambda w=w, cfg=cfg: qg.quant_matmul(x, w, None, cfg) for w in ws])
                    row = {"linear": name, "n": n, "k": k, "rows": rows, "format": fmt + suffix, "us": round(us, 2),
                           "gb_s": round(wb / us / 1e3), "pct_copy_bw": pct(wb, us),
                           "speedup_vs_bf16": round(base[rows] / us, 2), "config": cfg.to_json()}
                    if rows in (1, 512):
                        row["rel_err"] = rel_err(qg.quant_matmul(x, ws[0], None, cfg), x.float() @ dense.T)
                    emit(row)
            del weights, dense


def pct(weight_bytes: int, us: float) -> float:
    return round(100 * weight_bytes / (us * 1e-6) / copy_bytes_per_s(), 1)


def report_moe(deadline: float) -> None:
    name, e, h, i, top_k = MOE
    gen = torch.Generator(device="cuda").manual_seed(1)
    experts = {"bf16": (torch.randn(e, 2 * i, h, device="cuda", dtype=DTYPE) * h**-0.5,
                        torch.randn(e, h, i, device="cuda", dtype=DTYPE) * i**-0.5,
                        torch.randn(2 * i, h, device="cuda", dtype=DTYPE) * h**-0.5,
                        torch.randn(h, i, device="cuda", dtype=DTYPE) * i**-0.5)}
    for fmt in FORMATS:
        experts[fmt] = (random_weight(fmt, e, 2 * i, h, gen=gen), random_weight(fmt, e, h, i, gen=gen),
                        random_weight(fmt, 2 * i, h, gen=gen), random_weight(fmt, h, i, gen=gen))
    for tokens in MOE_TOKENS:
        x = torch.randn(tokens, h, device="cuda", dtype=DTYPE)
        routes = [routing_for(tokens, e, top_k, gen) for _ in range(16 if tokens == 1 else 2)]
        base = None
        for fmt, (w13, w2, s13, s2) in experts.items():
            if time.time() > deadline:
                emit({"moe": name, "skipped": "budget"})
                return
            us = time_us([lambda r=r: t_fused.fused_moe(x, w13, w2, *r, s13, s2) for r in routes])
            base = base or us
            row = {"moe": name, "tokens": tokens, "format": fmt, "us": round(us, 2),
                   "speedup_vs_bf16": round(base / us, 2)}
            if tokens == 1:  # 9 experts' bytes
                active = (nbytes(s13) + nbytes(s2)) * (top_k + 1)
                row.update(gb_s=round(active / us / 1e3), pct_copy_bw=pct(active, us))
            emit(row)


def routing_for(tokens: int, e: int, top_k: int, gen: torch.Generator):
    if tokens == 1:
        return routing(e, top_k, True, gen)
    logits = torch.randn(tokens, e, device="cuda", generator=gen)
    w, ids = torch.softmax(logits, -1).topk(top_k, dim=-1)
    ids = torch.cat([ids.int(), torch.full_like(ids[:, :1], e, dtype=torch.int32)], dim=1)
    return torch.cat([w, torch.rand(tokens, 1, device="cuda", generator=gen)], dim=1).contiguous(), ids.contiguous()


def tune_jobs(only: str = "") -> list[tuple[str, int]]:
    """(format, rows) to tune, the goals first: batch-1 decode, prefill; then the other
    decode sizes; NVFP4 last. ``only`` ("fp8:1,fp8:4"): these jobs alone."""
    jobs = ([("fp8", 1), ("int4", 1)] + [(fmt, rows) for fmt in ("fp8", "int4") for rows in PREFILL_TUNE_ROWS]
            + [(fmt, rows) for rows in TUNE_ROWS[1:] for fmt in ("fp8", "int4")]
            + [("nvfp4", rows) for rows in (*TUNE_ROWS, *PREFILL_TUNE_ROWS)])
    return [j for j in jobs if f"{j[0]}:{j[1]}" in only.split(",")] if only else jobs


def tune_cases(args, gen: torch.Generator):
    """Each tuned (format, rows, N, K): ``args.jobs`` of ``args.tune_models``' projections
    (``args.shapes`` "NxK,...": those alone), as (its key, a first weight, x, the
    candidates), generated one at a time so only one case's weights are alive."""
    sms = qg.sm_count(torch.device("cuda"))
    models = args.tune_models.split(",")
    shapes = [s for s, name in all_linear_shapes().items() if name.split(":")[0] in models and ":model." in name
              and (not args.shapes or f"{s[0]}x{s[1]}" in args.shapes.split(","))]
    for fmt, rows in tune_jobs(args.jobs):
        for n, k in shapes:
            first = random_weight(fmt, n, k, gen=gen)
            x = torch.randn(rows, k, device="cuda", dtype=DTYPE)
            candidates = (prefill_candidates(fmt, x, first) if rows > qg.DECODE_ROWS
                          else decode_candidates(fmt, rows, n, k, sms, args.fp8_tensor_cores,
                                                 cp.block_scaled_available(x, first)))
            yield (fmt, rows, n, k), first, x, candidates


def warm(args) -> None:
    """Compile this worker's share (``args.warm_share``, "i/P") of the tune's candidates by
    running each once, so Triton's file cache has them when the tune times them: a kernel
    source change leaves hundreds of launch shapes to compile (a few seconds each, on one
    core), and ``--warm P`` spreads them over P processes first."""
    index, count = (int(v) for v in args.warm_share.split("/"))
    gen = torch.Generator(device="cuda").manual_seed(2)
    seen = 0
    for _, first, x, candidates in tune_cases(args, gen):
        for cfg in candidates:
            seen += 1
            if seen % count == index:
                try:
                    qg.quant_matmul(x, first, None, cfg)
                except Exception:  # noqa: BLE001  (out of resources: the tune reports it)
                    pass
    torch.cuda.synchronize()


def warm_in_parallel(args, timeout: float) -> None:
    procs = [subprocess.Popen([sys.executable, __file__, "--parts", "warm", "--jobs", args.jobs,
                               "--shapes", args.shapes, "--tune-models", args.tune_models,
                               "--warm-share", f"{i}/{args.warm}"]
                              + (["--fp8-tensor-cores"] if args.fp8_tensor_cores else []),
                              stdout=subprocess.DEVNULL)
             for i in range(args.warm)]
    end = time.time() + timeout
    for proc in procs:
        try:
            proc.wait(max(1.0, end - time.time()))
        except subprocess.TimeoutExpired:
            proc.kill()
    emit({"warm": args.warm, "s": round(timeout - max(0.0, end - time.time()), 1)})


def tune(deadline: float, args) -> dict:
    """The winners, merged into the device's current table (or a copy of its stand-in's,
    :func:`table_to_extend`): entries not re-tuned here (other formats, row counts, shapes;
    or a budget that ran out) keep their shapes."""
    table = table_to_extend(ql.CONFIG_DIR, ql.device_name(torch.device("cuda")))
    table["_comment"] = ("Written by scripts/gpu_quant_gemm_sweep.py: format and (N, K, dtype) -> rows -> "
                         "the quantized GEMM's launch shape (fastest measured); absent: the heuristic.")
    gen = torch.Generator(device="cuda").manual_seed(2)
    for (fmt, rows, n, k), first, x, candidates in tune_cases(args, gen):
        if time.time() > deadline:
            emit({"tune": "stopped: budget spent"})
            return table
        ws = [first] + [random_weight(fmt, n, k, gen=gen) for _ in range(copies_for(nbytes(first), rows) - 1)]
        want = x.float() @ first.dequantize().T
        best = None
        for cfg in candidates:
            try:
                us = time_us([lambda w=w, cfg=cfg: qg.quant_matmul(x, w, None, cfg) for w in ws])
            except Exception as exc:  # noqa: BLE001  (out of resources: skip it)
                emit({"tune": fmt, "n": n, "k": k, "rows": rows, "config": cfg.to_json(), "error": str(exc)[:100]})
                continue
            emit({"timed": fmt, "n": n, "k": k, "rows": rows, "us": round(us, 2), "config": cfg.to_json()})
            if best is None or us < best[0]:
                best = (us, cfg)
        err = rel_err(qg.quant_matmul(x, ws[0], None, best[1]), want)
        emit({"tune": fmt, "n": n, "k": k, "rows": rows, "best_us": round(best[0], 2),
              "pct_copy_bw": pct(nbytes(first), best[0]), "config": best[1].to_json(), "rel_err": err})
        if err < (5e-2 if best[1].act_quant else 1e-2):  # x in e4m3 (block-scaled cuBLAS too)
            key = qg.table_key(qg.operands(first).tag, n, k, DTYPE)
            table.setdefault(key, {})[str(rows)] = best[1].to_json()
        del ws, first, want
    return table


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--parts", default="linear,moe,tune")
    ap.add_argument("--budget-s", type=float, default=270, help="stop starting new timings after this long")
    ap.add_argument("--write", action="store_true", help="write the tuned table into the source tree")
    ap.add_argument("--out-dir", default=None)
    ap.add_argument("--jobs", default="", help="tune only these format:rows pairs, e.g. fp8:1,fp8:4")
    ap.add_argument("--fp8-tensor-cores", action="store_true",
                    help="FP8 decode candidates with x quantized only (one numeric path for every row count)")
    ap.add_argument("--warm", type=int, default=0,
                    help="before tuning, compile the candidates in this many processes (up to 40%% of the budget)")
    ap.add_argument("--tune-models", default="qwen3.6-27b", help="the shapes whose projections the tune takes")
    ap.add_argument("--shapes", default="", help="tune only these of their shapes, e.g. 16384x5120,5120x6144")
    ap.add_argument("--warm-share", default="0/1", help=argparse.SUPPRESS)
    args = ap.parse_args()
    start = time.time()
    parts = args.parts.split(",")
    if parts == ["warm"]:  # one worker of --warm
        warm(args)
        return
    # the report parts take what they need; tuning gets the rest
    if "linear" in parts:
        report_linear(start + args.budget_s * (0.55 if "tune" in parts else 0.85))
    if "moe" in parts:
        report_moe(start + args.budget_s * (0.7 if "tune" in parts else 1.0))
    if "tune" in parts:
        if args.warm > 1:
            warm_in_parallel(args, 0.4 * args.budget_s)
        table = tune(start + args.budget_s, args)
        targets = write_table(table, ql.CONFIG_DIR, ql.device_name(torch.device("cuda")), args.out_dir, args.write)
        emit({"written": [str(p) for p in targets], "entries": len(table) - 1})
    emit({"done_s": round(time.time() - start, 1)})


if __name__ == "__main__":
    main()
