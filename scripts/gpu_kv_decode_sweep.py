#!/usr/bin/env python3
"""Tune decode attention at long contexts per KV format (GPU only).

For the gated attention of the Qwen3.6-27B shape (24 query / 4 KV heads of 256, page 16)
and each ``--formats`` entry (``bfloat16``: the one-launch decode kernel over the plain
cache; ``fp8``, ``int8``, ``nvfp4``, ``k8v4``: the one-launch decode kernel over a
quantized cache), times 16 back-to-back layers replayed from a CUDA graph at each
``--cases`` batch x context, over key splits, key-tile widths, warps and pipeline stages.
Every timing includes the q/k norm, RoPE and the new key's write. One JSON line per
timing: the microseconds a layer and the cache bytes read per second as a share of the
H200's copy bandwidth.

The shape with the least summed slowdown over the contexts (time over the best time at
that context) wins per format and batch; the winners are merged into the device's
table (``decode_attention_configs/<device>.json``: formats and batches not swept keep
their entries), written to ``--out-dir`` and, with ``--write``, into the source tree
(:mod:`ninfer_kernels.triton.decode_launch` reads it).

    python3 scripts/gpu_kv_decode_sweep.py --formats bfloat16,fp8 --cases 1x32768,1x131072,8x32768 --write

A format written ``fp8@unfused`` is a same-run peer, never tabled: the decode built from the
separate kernels (norm and RoPE, the quantized write, attention, the split merge).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from gpu_attention_sweep import decode_batch  # noqa: E402 (scripts/ is on sys.path)
from gpu_timing import bench, copy_bytes_per_s, graphed, rel_err  # noqa: E402

from ninfer.model.kv import HeadNormRope
from ninfer_kernels import kv_quant as ref
from ninfer_kernels.rope import rope_cos_sin
from ninfer_kernels.triton import decode_attention as da
from ninfer_kernels.triton import decode_launch as dl
from ninfer_kernels.triton import kv_quant as kq
from ninfer_kernels.triton import kv_quant_decode as kqd
from ninfer_kernels.triton.qk_norm_rope import qk_norm_rope
from ninfer_kernels.triton.tuned_tables import device_name, table_to_extend

HEADS, KV_HEADS, HEAD_D, ROT, PAGE, LAYERS = 24, 4, 256, 64, 16, 16
CODECS = {"fp8": ("fp8", "fp8"), "int8": ("int8", "int8"), "nvfp4": ("nvfp4", "nvfp4"), "k8v4": ("fp8", "nvfp4")}


def codec(name: str) -> ref.KVCodec:
    return {"fp8": ref.FP8, "int8": ref.INT8}.get(name) or ref.nvfp4()


def candidates(c: int, args) -> list[dl.DecodeLaunch]:
    """Split counts giving 64..1024 programs (``--splits`` narrows them), each with every
    tile / warps / stages choice."""
    splits = [s for s in (4, 8, 16, 32, 64, 128) if 64 <= c * KV_HEADS * s <= 1024
              and (not args.splits or str(s) in args.splits.split(","))]
    return [dl.DecodeLaunch(s, bn, w, st) for s in splits for bn in map(int, args.block_n.split(","))
            for w in map(int, args.warps.split(",")) for st in map(int, args.stages.split(","))]


def quant_parts(name: str, blocks: int, dev) -> tuple[list, list, ref.KVCodec, ref.KVCodec]:
    """Pages of random K/V stored in format ``name`` (quantized once, then repeated), laid out
    as the cache lays them out."""
    kc, vc = (codec(n) for n in CODECS[name.partition("@")[0]])
    sample = torch.randn(PAGE, KV_HEADS, HEAD_D, device=dev)
    parts = []
    for values, c in ((False, kc), (True, vc)):
        stored = ref.allocate_parts(c, blocks, PAGE, KV_HEADS, HEAD_D, dev, values=values)
        for part, one in zip(stored, c.quantize(sample)):
            if part.dtype.is_floating_point and part.dtype.itemsize == 1:  # float8: copy the bytes
                part, one = part.view(torch.uint8), one.view(torch.uint8)
            part.copy_(one[None])
        parts.append(stored)
    return parts[0], parts[1], kc, vc


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--formats", default="bfloat16,fp8,k8v4")
    ap.add_argument("--cases", default="1x32768,1x131072,8x32768")
    ap.add_argument("--block-n", default="32,64")
    ap.add_argument("--warps", default="4")
    ap.add_argument("--stages", default="1,2")
    ap.add_argument("--splits", default="", help="only these split counts (comma-separated)")
    ap.add_argument("--budget-s", type=float, default=240, help="shared evenly by the formats and their cases")
    ap.add_argument("--write", action="store_true")
    ap.add_argument("--out-dir", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    cases = [tuple(map(int, c.split("x"))) for c in args.cases.split(",")]
    max_ctx = max(ctx for _, ctx in cases)
    table = rope_cos_sin(max_ctx + 1, ROT, 1_000_000.0, torch.float32, dev)
    formats = args.formats.split(",")
    times: dict[tuple[str, int], dict[dl.DecodeLaunch, dict[int, float]]] = {}
    for f_index, fmt in enumerate(formats):
        for c, ctx in cases:  # each case its share: the first must not starve the longest
            deadline = time.monotonic() + args.budget_s / len(formats) / len(cases)
            batch = decode_batch(c, ctx, max_ctx, dev)
            blocks = int(batch.block_tables.max()) + 1
            q = torch.randn(c, HEADS, HEAD_D, dtype=torch.bfloat16, device=dev)
            k = torch.randn(c, KV_HEADS, HEAD_D, dtype=torch.bfloat16, device=dev)
            v = torch.randn_like(k)
            w = torch.ones(HEAD_D, dtype=torch.bfloat16, device=dev)
            pos = batch.seq_lens.long() - 1
            if fmt == "bfloat16":
                k_cache = torch.randn(blocks, PAGE, KV_HEADS, HEAD_D, dtype=torch.bfloat16, device=dev)
                v_cache = torch.randn_like(k_cache)
                per_token = 2 * HEAD_D * 2

                def run(launch):
                    da.LAUNCH_SHAPES[HEAD_D] = (launch.num_warps, launch.num_stages, launch.block_n,
                                                launch.block_n, 1)
                    return da.decode_attention(q, k, v, w, w, 1e-6, pos, table, ROT, k_cache, v_cache, batch,
                                               HEAD_D**-0.5, num_splits=launch.splits)
            else:
                kp, vp, kc, vc = quant_parts(fmt, blocks, dev)
                per_token = kc.bytes_per_head(HEAD_D) + vc.bytes_per_head(HEAD_D)
                norm = HeadNormRope(q_weight=w, k_weight=w, eps=1e-6, positions=pos, cos_sin=table, rotary_dim=ROT)
                variant = fmt.partition("@")[2]

                def run(launch):
                    if variant == "unfused":
                        q_rot, k_rot = qk_norm_rope(q, k, w, w, 1e-6, pos, table, ROT)
                        kq.write_kv_quant(kp, vp, kc, vc, k_rot, v, batch.slot_mapping)
                        return kq.paged_attention_quant(q_rot, kp, vp, kc, vc, batch, HEAD_D**-0.5, launch=launch)
                    return kqd.decode_attention_quant(q, k, v, norm, kp, vp, kc, vc, batch, HEAD_D**-0.5,
                                                      launch=launch)
            read = c * ctx * KV_HEADS * per_token  # bytes a layer reads
            want = run(dl.DecodeLaunch(1, 64, 4, 1)).float()  # one split: nothing to merge
            for launch in candidates(c, args):
                if time.monotonic() > deadline:
                    break
                try:
                    err = rel_err(run(launch).float(), want)
                    if not err < 2e-2:  # a shape that computes something else never enters the table
                        raise ValueError(f"relative error {err} against one split")
                    ms = bench(graphed(lambda: [run(launch) for _ in range(LAYERS)]), rep=40, warmup=10)
                except Exception as e:  # noqa: BLE001 (a shape that does not compile is a result too)
                    print(json.dumps({"format": fmt, "batch": c, "context": ctx, **launch.to_json(),
                                      "error": str(e)[:200]}), flush=True)
                    continue
                us = ms * 1000 / LAYERS
                times.setdefault((fmt, c), {}).setdefault(launch, {})[ctx] = us
                print(json.dumps({"format": fmt, "batch": c, "context": ctx, **launch.to_json(),
                                  "us_per_layer": round(us, 2),
                                  "bandwidth_pct": round(100 * read / (us * 1e-6) / copy_bytes_per_s(), 1)}),
                      flush=True)
            torch.cuda.empty_cache()
        print(json.dumps({"format": fmt, "done": f_index + 1, "of": len(formats)}), flush=True)
    write_table(times, cases, args)


def write_table(times, cases, args) -> None:
    """Per format and batch, the shape with the least summed slowdown over its contexts,
    merged into the device's table (formats and batches not swept keep their entries)."""
    card = device_name(torch.device("cuda"))
    name = f"{card}.json"
    out = table_to_extend(dl.CONFIG_DIR, card)
    out["_comment"] = "scripts/gpu_kv_decode_sweep.py on this device: format -> batch -> launch"
    for (fmt, c), per_launch in sorted(times.items()):
        contexts = {ctx for bc, ctx in cases if bc == c}
        full = {launch: t for launch, t in per_launch.items() if set(t) == contexts}
        if not full:
            continue
        best = {ctx: min(t[ctx] for t in full.values()) for ctx in contexts}
        winner = min(full, key=lambda launch: sum(full[launch][ctx] / best[ctx] for ctx in contexts))
        print(json.dumps({"winner": fmt, "batch": c, **winner.to_json(),
                          "us_per_layer": {ctx: round(full[winner][ctx], 2) for ctx in sorted(contexts)}}), flush=True)
        if "@" not in fmt:  # a layout the cache does not use is timed, never tabled
            kv_format = fmt if fmt == "bfloat16" else kq.kv_format_name(*(codec(n) for n in CODECS[fmt]))
            out.setdefault(dl.format_key(kv_format, HEAD_D), {})[str(c)] = winner.to_json()
    text = json.dumps(out, indent=1) + "\n"
    if args.out_dir:
        Path(args.out_dir, name).write_text(text)
    if args.write:
        dl.CONFIG_DIR.mkdir(exist_ok=True)
        (dl.CONFIG_DIR / name).write_text(text)


if __name__ == "__main__":
    main()
