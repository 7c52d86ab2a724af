#!/usr/bin/env python3
"""Tune the quantized experts' launch shapes (``quant_moe_configs/<device>.json``).

For each format (``--formats fp8,int4``), MoE layer (``--models``) and token count
(``--tokens 1,8192``): the experts built on the GPU at the model's shape (random codes and
scales, a shared expert in the experts' format where the model has one), a few routings
(sixteen of one token, so the 9 experts a call reads come from past the L2, as in a
decode step), and the whole ``quant_fused_moe`` call (both kernels) timed from a CUDA graph
replaying them all. The gate_up launch's shapes are timed first with the heuristic's down,
then the down's with the best gate_up (:mod:`quant_candidates`: the one-row steps for a
single token, the grouped GEMM's tiles for more); the bf16 kernels at the same shape are
timed beside them for scale. JSON lines on stdout; the winners merge into the device's
table (entries not re-tuned keep theirs), written to ``--out-dir`` and, with ``--write``,
into the source tree.

Compiling a hundred launch shapes takes minutes on one core: ``--warm P`` compiles them in
P processes first.

    python3 scripts/gpu_quant_moe_tune.py --formats fp8,int4 --tokens 1,8192 --warm 12 --write --out-dir "$OUT"
"""

from __future__ import annotations

import argparse
import itertools
import subprocess
import sys
import time

import torch
from gpu_quant_gemm_sweep import DTYPE, emit, nbytes, pct, random_weight, routing_for, time_us  # noqa: E402
from gpu_skinny_sweep import MOE_SHAPES  # noqa: E402
from gpu_timing import rel_err  # noqa: E402
from quant_candidates import moe_grouped_candidates, moe_one_token_candidates  # noqa: E402

from ninfer_kernels.triton import fused_moe as t_fused
from ninfer_kernels.triton import quant_moe as qm
from ninfer_kernels.triton import quant_moe_shapes as qms
from ninfer_kernels.triton.quant_gemm import operands
from ninfer_kernels.triton.quant_tiles import FP8, INT4
from ninfer_kernels.triton.tuned_tables import device_name, table_to_extend, write_table


def inputs(model: str, tokens: int, gen: torch.Generator):
    """x and routings of ``tokens`` tokens: sixteen for one token (the weights they read past
    the L2), two for more (the math dominates)."""
    e, h, _, top_k, shared = MOE_SHAPES[model]
    x = torch.randn(tokens, h, device="cuda", dtype=DTYPE)
    routes = []
    for _ in range(16 if tokens == 1 else 2):
        w, ids = routing_for(tokens, e, top_k, gen)  # with the shared expert's column (id e)
        routes.append((w, ids) if shared else (w[:, :-1].contiguous(), ids[:, :-1].contiguous()))
    return x, routes


def layer(fmt: str, model: str, tokens: int, gen: torch.Generator):
    """(x, experts as quant_fused_moe takes them, routings, the table key, the heuristic)."""
    e, h, i, top_k, shared = MOE_SHAPES[model]
    w13, w2 = random_weight(fmt, e, 2 * i, h, gen=gen), random_weight(fmt, e, h, i, gen=gen)
    s13, s2 = (random_weight(fmt, 2 * i, h, gen=gen), random_weight(fmt, h, i, gen=gen)) if shared else (None, None)
    x, routes = inputs(model, tokens, gen)
    key = qms.table_key(operands(w13).tag, e + shared, h, i, top_k + shared, DTYPE)
    base = qms.heuristic_config(FP8 if fmt == "fp8" else INT4, e + shared, top_k + shared, tokens)
    return x, (w13, w2, s13, s2), routes, key, base


def candidates(fmt: str, part: str, base: qms.QuantMoeConfig, tokens: int) -> list[qms.QuantMoeConfig]:
    return (moe_one_token_candidates if tokens == 1 else moe_grouped_candidates)(fmt, part, base)


def call(x, experts, route, config):
    w13, w2, s13, s2 = experts
    return qm.quant_fused_moe(x, w13, w2, *route, s13, s2, config=config, summed=False)


def active_bytes(experts, route) -> int:
    """What one call reads: the routed experts' (and the shared one's) codes and scales."""
    w13, w2 = experts[:2]
    per_expert = (nbytes(w13) + nbytes(w2)) // w13.shape[0]
    return per_expert * route[1].shape[1]


def warm(args) -> None:
    """Run this worker's share (``args.warm_share``, "i/P") of every candidate once."""
    index, count = (int(v) for v in args.warm_share.split("/"))
    gen = torch.Generator(device="cuda").manual_seed(0)
    seen = 0
    for fmt, model, tokens in itertools.product(args.formats.split(","), args.models.split(","), args.token_counts):
        x, experts, routes, _, base = layer(fmt, model, tokens, gen)
        for part in ("gate_up", "down"):
            # (the down's candidates vary the heuristic's gate_up: the tuned one is not known yet)
            for cfg in candidates(fmt, part, base, tokens):
                seen += 1
                if seen % count == index:
                    try:
                        call(x, experts, routes[0], cfg)
                    except Exception:  # noqa: BLE001  (out of resources: the tune reports it)
                        pass
    torch.cuda.synchronize()


def warm_in_parallel(args) -> None:
    start = time.time()
    procs = [subprocess.Popen([sys.executable, __file__, "--formats", args.formats, "--models", args.models,
                               "--tokens", args.tokens, "--warm-share", f"{i}/{args.warm}"], stdout=subprocess.DEVNULL)
             for i in range(args.warm)]
    for proc in procs:
        try:
            proc.wait(max(1.0, start + args.warm_s - time.time()))
        except subprocess.TimeoutExpired:
            proc.kill()
    emit({"warm": args.warm, "s": round(time.time() - start, 1)})


def best_of(x, experts, routes, configs, label: dict, deadline: float):
    best = None
    for cfg in configs:
        if time.time() > deadline:
            emit({**label, "stopped": "budget spent"})
            break
        try:
            us = time_us([lambda r=r, cfg=cfg: call(x, experts, r, cfg) for r in routes])
        except Exception as exc:  # noqa: BLE001
            emit({**label, "config": cfg.to_json(), "error": str(exc)[:100]})
            continue
        emit({**label, "us": round(us, 2), "config": cfg.to_json()})
        if best is None or us < best[0]:
            best = (us, cfg)
    return best


def bf16_us(model: str, tokens: int, gen: torch.Generator) -> float:
    """The bf16 kernels at ``model``'s shape, for scale."""
    e, h, i, _, shared = MOE_SHAPES[model]
    w13 = torch.randn(e, 2 * i, h, device="cuda", dtype=DTYPE) * h**-0.5
    w2 = torch.randn(e, h, i, device="cuda", dtype=DTYPE) * i**-0.5
    s13, s2 = (w13[0].clone(), w2[0].clone()) if shared else (None, None)
    x, routes = inputs(model, tokens, gen)
    us = time_us([lambda r=r: t_fused.fused_moe(x, w13, w2, *r, s13, s2, summed=False) for r in routes])
    row = {"model": model, "tokens": tokens, "format": "bf16", "us": round(us, 2)}
    if tokens == 1:
        row["pct_copy_bw"] = pct((w13.nbytes + w2.nbytes) // e * routes[0][1].shape[1], us)
    emit(row)
    return us


def tune_layer(fmt: str, model: str, tokens: int, gen: torch.Generator, reference_us: float, deadline: float):
    """The best config of ``fmt`` experts at ``model``'s shape for ``tokens``: (key, config) or None."""
    x, experts, routes, key, base = layer(fmt, model, tokens, gen)
    label = {"model": model, "tokens": tokens, "format": fmt}
    chosen = base
    for part in ("gate_up", "down"):
        found = best_of(x, experts, routes, candidates(fmt, part, chosen, tokens), {**label, "part": part},
                        deadline)
        if found is not None:
            chosen = found[1]
    us = time_us([lambda r=r: call(x, experts, r, chosen) for r in routes])
    base_us = time_us([lambda r=r: call(x, experts, r, base) for r in routes])
    # program shapes differ in the order their threads add a row's products, so not bit
    # for bit: within rounding of the heuristic's output
    err = rel_err(call(x, experts, routes[0], chosen), call(x, experts, routes[0], base))
    row = {**label, "best_us": round(us, 2), "heuristic_us": round(base_us, 2), "vs_bf16": round(reference_us / us, 2),
           "rel_err_vs_heuristic": err, "config": chosen.to_json()}
    if tokens == 1:
        row["pct_copy_bw"] = pct(active_bytes(experts, routes[0]), us)
    emit(row)
    return (key, chosen) if err < 1e-2 else None


def tune(args) -> dict:
    table = table_to_extend(qms.CONFIG_DIR, device_name(torch.device("cuda")))
    table["_comment"] = ("Written by scripts/gpu_quant_moe_tune.py: expert format and MoE layer -> tokens -> "
                         "the quantized fused MoE's launch shapes (fastest measured); absent: the heuristic.")
    deadline = time.time() + args.budget_s
    gen = torch.Generator(device="cuda").manual_seed(0)
    for model, tokens in itertools.product(args.models.split(","), args.token_counts):
        reference = bf16_us(model, tokens, gen)
        for fmt in args.formats.split(","):
            found = tune_layer(fmt, model, tokens, gen, reference, deadline)
            if found is not None:
                table.setdefault(found[0], {})[str(tokens)] = found[1].to_json()
    return table


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--formats", default="fp8,int4")
    ap.add_argument("--models", default="qwen3.6-35b-a3b")
    ap.add_argument("--tokens", default="1", help="token counts to tune, e.g. 1,8192 (a prefill chunk)")
    ap.add_argument("--budget-s", type=float, default=200, help="stop starting new timings after this long")
    ap.add_argument("--warm", type=int, default=0, help="compile the candidates in this many processes first")
    ap.add_argument("--warm-s", type=float, default=120, help="at most this long")
    ap.add_argument("--write", action="store_true", help="write the table into the source tree")
    ap.add_argument("--out-dir", default=None)
    ap.add_argument("--warm-share", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.token_counts = [int(t) for t in args.tokens.split(",")]
    if args.warm_share:  # one worker of --warm
        warm(args)
        return
    start = time.time()
    if args.warm > 1:
        warm_in_parallel(args)
    table = tune(args)
    targets = write_table(table, qms.CONFIG_DIR, device_name(torch.device("cuda")), args.out_dir, args.write)
    emit({"written": [str(p) for p in targets], "done_s": round(time.time() - start, 1)})


if __name__ == "__main__":
    main()
