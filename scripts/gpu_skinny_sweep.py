#!/usr/bin/env python3
"""Tune the batch-1..16 kernels against what they replace, and write the tables.

1. ``linear``: every projection shape of the MoE models (Qwen3.6-35B-A3B, Qwen3-30B-A3B;
   from the models built on the meta device), each row count 1..16: cuBLAS on the
   weight as the engine stores it (column-major) against the candidates of
   :mod:`ninfer_kernels.triton.skinny_linear`. A shape and row count gets a table entry
   when its best candidate is at least ``--margin`` faster than cuBLAS and matches it.
2. ``moe``: one token through :mod:`ninfer_kernels.triton.moe_single_token` (gate_up
   shapes, then down shapes on the best gate_up) against the grouped GEMMs and their
   sum (the tuned table's M=1 entry). The winner goes into the MoE table's M=1 entry
   as ``one_token`` when faster.

Each timing replays a CUDA graph of back-to-back calls, as a decode step runs them
(launch gaps and PDL overlap included), each call on its own copy of the weight (or, for
the experts, its own routing), so that no call finds its weights in L2. ``--write`` updates the tables in the
source tree; they are also copied to ``--out-dir``. JSON lines on stdout.

    python3 scripts/gpu_skinny_sweep.py --write --out-dir "$OUT"
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import tempfile
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F
from gpu_timing import bench, captured, rel_err  # noqa: E402 (scripts/ is on sys.path)

from ninfer_kernels.triton import fused_moe as t_fused
from ninfer_kernels.triton import moe_single_token as t_one
from ninfer_kernels.triton import skinny_linear as sk
from ninfer_kernels.triton.tuned_tables import table_to_extend

DTYPE = torch.bfloat16
MODEL_SHAPES = ("qwen3.6-35b-a3b", "qwen3-30b-a3b")
#: name -> (routed experts, hidden, expert intermediate, top_k, shared expert)
MOE_SHAPES = {"qwen3.6-35b-a3b": (256, 2048, 512, 8, True), "qwen3-30b-a3b": (128, 2048, 768, 8, False)}
ROWS = (1, 2, 4, 8)
LINEAR_CANDIDATES = [sk.SkinnyConfig(n, k, s, 4, 3) for n, k, s in itertools.product(
    (32, 64, 128), (128, 256), (1, 2, 4, 8))] + [
    # the weight tile first (session 22, untimed): sm_90 code feeds Hopper's warpgroup MMA
    # the pipelined weight tile from shared memory, where x-first loads it into registers
    sk.SkinnyConfig(n, k, s, 4, 3, swap=True) for n, k, s in itertools.product((64, 128), (128, 256), (1, 2, 4, 8))]
#: bytes of weight copies per timing: well past the H200's L2
ROTATION_BYTES = 400 << 20
MAX_COPIES = 48
# (rows, K tile, warps, stages): stages 3 stage the weight tiles through shared memory
GATE_UP_CANDIDATES = list(itertools.product((1, 2, 4, 8), (512, 1024, 2048), (2, 4), (1, 3)))
DOWN_CANDIDATES = list(itertools.product((4, 8, 16, 32), (256, 512, 1024), (2, 4), (1, 3)))  # 1024: I = 768 in one step


def time_us(calls) -> float:
    """Microseconds per call of ``calls`` (a list of closures) replayed from one graph."""
    replay, _ = captured(lambda: [c() for c in calls])
    return bench(replay, rep=20, warmup=5) * 1e3 / len(calls)


def emit(row: dict) -> None:
    print(json.dumps(row), flush=True)


def linear_shapes(shape: str, segments: bool = False) -> dict[tuple[int, int], str]:
    """{(N, K): first module name} of the model's Linear layers, LM head and 1-row gates aside.

    ``segments``: the products a quantized checkpoint of the shape runs instead, where a
    fused layer holds shards that released checkpoints keep dense (Gated DeltaNet's
    ``in_proj_b`` / ``in_proj_a``, :data:`ninfer_plugins.weights.tiny_targets.KEPT_DENSE`): its
    quantized rows and its dense rows as two shapes, the dense one named ``...[dense]``
    (the 27B's in_proj: 16,384 quantized rows and 96 dense ones, not one of 16,480)."""
    from ninfer.model import random_weights as rw
    from ninfer.model.loader import find_family, read_config
    from ninfer.plugins import load_registry
    from ninfer_plugins.models.layers import Linear
    from ninfer_plugins.weights.tiny_targets import KEPT_DENSE

    cfg = read_config(rw.config_dir(shape, Path(tempfile.mkdtemp())))
    model = find_family(load_registry(), cfg).build(cfg, DTYPE, torch.device("meta"))
    dense_rows: dict[str, set[int]] = {}
    for name, module in model.named_modules() if segments else ():
        for shard, (target, rows) in getattr(module, "fused_shards", dict)().items():
            if shard in KEPT_DENSE:
                dense_rows.setdefault(f"{name}.{target}", set()).update(range(*rows.indices(1 << 30)))
    found: dict[tuple[int, int], str] = {}
    for name, module in model.named_modules():
        if isinstance(module, Linear) and not module.keep_row_major and "lm_head" not in name:
            n, k = module.weight.shape
            dense = dense_rows.get(name, set())
            for rows, is_dense in ((n - len(dense), False), (len(dense), True)):
                if rows > 1:
                    found.setdefault((rows, k), name + ("[dense]" if is_dense else ""))
    return found


LINEAR_COMMENT = ("Written by scripts/gpu_skinny_sweep.py: (N, K, dtype) -> rows -> the skinny kernel's launch "
                  "shape, where it measured faster than cuBLAS; absent: cuBLAS.")


def sweep_linear(margin: float, models: list[str], rows_swept=ROWS,
                 dense_segments: bool = False) -> dict[str, dict[str, dict | None]]:
    """Per shape and swept row count, the kernel's config where it is taken, else None
    (cuBLAS). ``dense_segments``: only the dense rows quantized checkpoints keep beside
    quantized ones (:func:`linear_shapes`' ``[dense]`` shapes)."""
    verdicts: dict[str, dict[str, dict | None]] = {}
    shapes: dict[tuple[int, int], str] = {}
    for model in models:
        for key, name in linear_shapes(model, segments=dense_segments).items():
            if name.endswith("[dense]") or not dense_segments:
                shapes.setdefault(key, f"{model}:{name}")
    for (n, k), name in shapes.items():
        copies = max(2, min(MAX_COPIES, ROTATION_BYTES // (n * k * 2)))
        # as stored: Linear weights column-major (store_linears_column_major), a quantized
        # layer's dense segments row-major as the checkpoint has them
        ws = [torch.randn(n, k, device="cuda", dtype=DTYPE) * k**-0.5 for _ in range(copies)]
        ws = ws if name.endswith("[dense]") else [w.t().contiguous().t() for w in ws]
        entry = {}
        for rows in rows_swept:
            x = torch.randn(rows, k, device="cuda", dtype=DTYPE)
            want = F.linear(x, ws[0])
            cublas = time_us([lambda w=w: F.linear(x, w) for w in ws])
            best = None
            for cfg in LINEAR_CANDIDATES:
                try:
                    us = time_us([lambda w=w, cfg=cfg: sk.skinny_linear(x, w, None, cfg) for w in ws])
                except Exception as exc:  # noqa: BLE001  (out of resources: skip it)
                    emit({"linear": name, "rows": rows, "config": cfg.to_json(), "error": str(exc)[:100]})
                    continue
                if best is None or us < best[0]:
                    best = (us, cfg)
            err = rel_err(sk.skinny_linear(x, ws[0], None, best[1]), want)
            bytes_read = n * k * 2
            take = best[0] < cublas * (1 - margin) and err < 1e-2
            emit({"linear": name, "n": n, "k": k, "rows": rows, "cublas_us": round(cublas, 2),
                  "skinny_us": round(best[0], 2), "skinny_config": best[1].to_json(), "rel_err": err,
                  "cublas_gb_s": round(bytes_read / cublas / 1e3), "skinny_gb_s": round(bytes_read / best[0] / 1e3),
                  "taken": take})
            entry[str(rows)] = best[1].to_json() if take else None
        del ws
        verdicts[sk.table_key(n, k, DTYPE)] = entry
    return verdicts


def merge_linear(table: dict, verdicts: dict[str, dict[str, dict | None]]) -> dict:
    """``table`` with the swept row counts replaced (None: that row count back to cuBLAS);
    shapes and row counts not swept keep their entries (a first table starts as a copy of
    the stand-in card's, :func:`table_to_extend`)."""
    table["_comment"] = LINEAR_COMMENT
    for key, per_rows in verdicts.items():
        entry = table.setdefault(key, {})
        for rows, cfg in per_rows.items():
            if cfg is None:
                entry.pop(rows, None)
            else:
                entry[rows] = cfg
        if not entry:
            del table[key]
    return table


def routing(num_experts: int, top_k: int, shared: bool, gen: torch.Generator):
    ids = torch.randperm(num_experts, device="cuda", generator=gen)[:top_k].int()[None]
    w = torch.rand(1, top_k, device="cuda", generator=gen)
    w = w / w.sum(-1, keepdim=True)
    if shared:
        ids = torch.cat([ids, torch.full_like(ids[:, :1], num_experts)], dim=1)
        w = torch.cat([w, torch.rand(1, 1, device="cuda", generator=gen)], dim=1)
    return w.contiguous(), ids.contiguous()


def sweep_moe(models: list[str]) -> dict[str, t_one.SingleTokenConfig]:
    """{MoE table key: the best single-token config} where it beat the grouped GEMMs."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    chosen = {}
    for model in models:
        e, h, i, top_k, shared = MOE_SHAPES[model]
        w13 = torch.randn(e, 2 * i, h, device="cuda", dtype=DTYPE) * h**-0.5
        w2 = torch.randn(e, h, i, device="cuda", dtype=DTYPE) * i**-0.5
        s13 = torch.randn(2 * i, h, device="cuda", dtype=DTYPE) * h**-0.5 if shared else None
        s2 = torch.randn(h, i, device="cuda", dtype=DTYPE) * i**-0.5 if shared else None
        x = torch.randn(1, h, device="cuda", dtype=DTYPE)
        routes = [routing(e, top_k, shared, gen) for _ in range(16)]  # other experts each call
        k_out = top_k + shared
        os.environ["NINFER_MOE_ONE_TOKEN"] = "0"
        want = t_fused.fused_moe(x, w13, w2, *routes[0], s13, s2)
        grouped = time_us([lambda r=r: t_fused.fused_moe(x, w13, w2, *r, s13, s2) for r in routes])
        os.environ["NINFER_MOE_ONE_TOKEN"] = "1"

        def run(cfg, route):
            return t_fused.sum_pairs(t_one.expert_rows_one_token(x, w13, w2, *route, s13, s2, cfg), 1, k_out)

        def timed(cfg):
            return time_us([lambda r=r: run(cfg, r) for r in routes])

        best = None
        for n, k, warps, stages in GATE_UP_CANDIDATES:
            cfg = t_one.SingleTokenConfig(gate_up_n=n, gate_up_k=k, gate_up_warps=warps, gate_up_stages=stages)
            us = timed(cfg)
            if best is None or us < best[0]:
                best = (us, cfg)
        for n, k, warps, stages in DOWN_CANDIDATES:
            cfg = replace(best[1], down_n=n, down_k=k, down_warps=warps, down_stages=stages)
            us = timed(cfg)
            if us < best[0]:
                best = (us, cfg)
        err = rel_err(run(best[1], routes[0]), want)
        default_us = timed(t_one.DEFAULT_CONFIG)
        active = k_out * 3 * i * h * 2
        emit({"moe_one_token": model, "grouped_us": round(grouped, 2), "default_us": round(default_us, 2),
              "best_us": round(best[0], 2), "best": best[1].__dict__, "rel_err_vs_grouped": err,
              "grouped_gb_s": round(active / grouped / 1e3), "best_gb_s": round(active / best[0] / 1e3)})
        if best[0] < grouped and err < 2e-2:
            chosen[t_fused.shape_key(e + shared, h, i, k_out, DTYPE)] = best[1]
    return chosen


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--parts", default="linear,moe")
    ap.add_argument("--moe-models", default=",".join(MOE_SHAPES), help="the MoE shapes the moe part sweeps")
    ap.add_argument("--linear-models", default=",".join(MODEL_SHAPES), help="the shapes whose projections the "
                    "linear part sweeps")
    ap.add_argument("--margin", type=float, default=0.03, help="how much faster than cuBLAS to take the kernel "
                    "(negative: also kernels slower by at most that share, for whole-step A/Bs)")
    ap.add_argument("--rows", default=",".join(map(str, ROWS)), help="the linear part's row counts")
    ap.add_argument("--dense-segments", action="store_true", help="the linear part sweeps only the dense rows "
                    "quantized checkpoints keep beside quantized ones (Gated DeltaNet's in_proj_b/a)")
    ap.add_argument("--write", action="store_true", help="update the tables in the source tree")
    ap.add_argument("--out-dir", default=None)
    args = ap.parse_args()
    parts = args.parts.split(",")
    device = t_fused.device_name(torch.device("cuda"))
    written = []
    if "linear" in parts:
        verdicts = sweep_linear(args.margin, args.linear_models.split(","), [int(r) for r in args.rows.split(",")],
                                args.dense_segments)
        table = merge_linear(table_to_extend(sk.CONFIG_DIR, device), verdicts)
        path = sk.CONFIG_DIR / f"{device}.json"
        if args.write:
            path.parent.mkdir(exist_ok=True)
            path.write_text(json.dumps(table, indent=1) + "\n")
            written.append(path)
    if "moe" in parts:
        chosen = sweep_moe(args.moe_models.split(","))
        path = t_fused.CONFIG_DIR / f"{device}.json"
        if args.write and chosen:
            raw = table_to_extend(t_fused.CONFIG_DIR, device)
            for key, cfg in chosen.items():
                raw.setdefault(key, {}).setdefault("1", {}).update({"one_token": cfg.__dict__})
            path.write_text(json.dumps(raw, indent=1) + "\n")
            written.append(path)
    if args.out_dir:
        for path in written:
            shutil.copy(path, Path(args.out_dir) / f"{path.parent.name}_{path.name}")
    emit({"written": [str(p) for p in written]})


if __name__ == "__main__":
    main()
