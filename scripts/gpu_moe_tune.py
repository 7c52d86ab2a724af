#!/usr/bin/env python3
"""Sweep fused-MoE block shapes on this GPU and write the table the loader reads.

For each shape (Qwen3.6-35B-A3B, Qwen3-30B-A3B; bf16) and each M (tokens in a call),
routing is random top-k per token over uniform experts (plus the shared column), as
decode sees it. For every ``block_m`` of M's class the gate_up candidates are timed,
then the down candidates on the best one's output; the ``block_m`` whose two best
kernels sum lowest wins. Times are triton.testing.do_bench medians with the L2 cache
flushed before each run (a decode step never finds a layer's experts in L2).

Run time is bounded three ways: candidate lists are short and tied to ``block_m`` (19
GEMM shapes in all, so about 76 compiles over both kernels and both shapes; Triton
compiles each once and reuses it for every M, since the pair-count arguments are not
specialised); each timing gets a few milliseconds; and a deadline (``--budget-s``,
default 150 s) stops the sweep, the M values left over keep the previous table's
entry or the heuristic (they are listed on stdout). ``--quick`` keeps the first two
candidates per ``block_m`` and every other M.

The chosen config of every M is then checked against the heuristic config's output.

    python3 scripts/gpu_moe_tune.py --out kernels/triton/moe_configs/NVIDIA_H200.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
from triton.testing import do_bench

from ninfer_kernels.triton import fused_moe as t_fused
from ninfer_kernels.triton import moe_route as t_route
from ninfer_kernels.triton.fused_moe import GemmConfig, MoeConfig

#: name -> (routed experts, hidden, expert intermediate, top_k, shared expert)
SHAPES = {"qwen3.6-35b-a3b": (256, 2048, 512, 8, True), "qwen3-30b-a3b": (128, 2048, 768, 8, False)}
MS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192]
DTYPE = torch.bfloat16
DEVICE = "cuda"  # (a CPU smoke test of the logic swaps it, with the timers)
#: (BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages) per block_m, likeliest first
CANDIDATES = {
    16: [(64, 128, 1, 4, 3), (32, 128, 1, 4, 4), (64, 256, 1, 4, 3), (32, 256, 1, 4, 3), (128, 128, 1, 4, 3),
         (64, 64, 1, 4, 4)],
    32: [(64, 128, 8, 4, 3), (128, 64, 8, 4, 4), (32, 128, 8, 4, 4), (128, 128, 8, 8, 3)],
    64: [(128, 64, 8, 8, 3), (128, 64, 8, 4, 4), (64, 128, 8, 4, 3), (128, 128, 8, 8, 3), (256, 64, 8, 8, 3)],
    128: [(128, 64, 8, 8, 3), (128, 64, 8, 8, 4), (256, 64, 8, 8, 2), (64, 64, 8, 4, 4)],
}
SMEM_LIMIT = 227 * 1024  # an H100/H200 block's most


def block_m_choices(pairs_per_expert: float) -> list[int]:
    if pairs_per_expert <= 8:
        return [16]
    if pairs_per_expert <= 32:
        return [16, 32]
    if pairs_per_expert <= 128:
        return [32, 64]
    return [64, 128]


def smem_bytes(block_m: int, cfg: GemmConfig, b_tiles: int) -> int:
    """Shared memory of a pipelined GEMM: every stage holds one A and ``b_tiles`` B tiles."""
    return cfg.num_stages * 2 * cfg.BLOCK_K * (block_m + b_tiles * cfg.BLOCK_N)


def time_ms(fn) -> float:
    return do_bench(fn, warmup=2, rep=8, return_mode="median")


def routing(tokens: int, num_experts: int, top_k: int, shared: bool, gen: torch.Generator):
    """Uniform random top-k per token (random weights summing to 1), plus the shared column."""
    ids = torch.rand(tokens, num_experts, device=DEVICE, generator=gen).topk(top_k, dim=-1).indices.int()
    w = torch.rand(tokens, top_k, device=DEVICE, generator=gen)
    w = w / w.sum(-1, keepdim=True)
    if shared:
        ids = torch.cat([ids, torch.full_like(ids[:, :1], num_experts)], dim=1)
        w = torch.cat([w, torch.rand(tokens, 1, device=DEVICE, generator=gen)], dim=1)
    return w.contiguous(), ids.contiguous()


class Sweep:
    def __init__(self, deadline: float, quick: bool):
        self.deadline = deadline
        self.quick = quick
        self.skipped: list[str] = []

    def out_of_time(self) -> bool:
        return time.perf_counter() > self.deadline

    def best(self, run, block_m: int, b_tiles: int):
        """(ms, config) of the fastest candidate of ``block_m`` (None if none ran)."""
        found = None
        for spec in CANDIDATES[block_m][: 2 if self.quick else None]:
            cfg = GemmConfig(*spec)
            if smem_bytes(block_m, cfg, b_tiles) > SMEM_LIMIT or self.out_of_time():
                continue
            try:
                ms = time_ms(lambda: run(cfg))
            except Exception as exc:  # noqa: BLE001  (out of resources and the like: skip it)
                print(f"  bm={block_m} {spec}: {type(exc).__name__}: {str(exc)[:120]}", flush=True)
                continue
            if found is None or ms < found[0]:
                found = (ms, cfg)
        return found

    def tune_m(self, layer: dict, shape: tuple, tokens: int, gen: torch.Generator) -> MoeConfig | None:
        num_experts, hidden, inter, top_k, shared = shape
        total, k_out = num_experts + shared, top_k + shared
        x = torch.randn(tokens, hidden, device=DEVICE, generator=gen, dtype=DTYPE)
        weights, ids = routing(tokens, num_experts, top_k, shared, gen)
        results = []
        for block_m in block_m_choices(tokens * k_out / total):
            align = t_route.moe_align(ids, total, block_m)
            gate_up = self.best(lambda c: t_fused.gate_up(x, layer["w13"], layer["s13"], align, k_out, block_m, c),
                                block_m, 2)
            if gate_up is None:
                continue
            inter_rows = t_fused.gate_up(x, layer["w13"], layer["s13"], align, k_out, block_m, gate_up[1])
            down = self.best(lambda c: t_fused.down(inter_rows, layer["w2"], layer["s2"], weights, align, block_m, c),
                             block_m, 1)
            if down is None:
                continue
            results.append((gate_up[0] + down[0], MoeConfig(block_m, gate_up[1], down[1])))
            print(f"  M={tokens} bm={block_m}: gate_up {gate_up[0] * 1e3:.1f} us {gate_up[1]}, "
                  f"down {down[0] * 1e3:.1f} us {down[1]}", flush=True)
        return min(results, key=lambda r: r[0])[1] if results else None


def validate(layer: dict, shape: tuple, tokens: int, cfg: MoeConfig, gen: torch.Generator) -> float:
    """Relative difference of ``cfg``'s output from the heuristic config's."""
    num_experts, hidden, _, top_k, shared = shape
    x = torch.randn(tokens, hidden, device=DEVICE, generator=gen, dtype=DTYPE)
    weights, ids = routing(tokens, num_experts, top_k, shared, gen)
    args = (x, layer["w13"], layer["w2"], weights, ids, layer["s13"], layer["s2"])
    got = t_fused.fused_moe(*args, config=cfg).double()
    want = t_fused.fused_moe(*args, config=t_fused.heuristic_config(num_experts + shared, top_k + shared, tokens))
    return float((got - want.double()).norm() / want.double().norm().clamp_min(1e-30))


def make_layer(num_experts: int, hidden: int, inter: int, shared: bool, gen: torch.Generator) -> dict:
    def rand(*shape, scale):
        return torch.randn(*shape, device=DEVICE, generator=gen, dtype=DTYPE) * scale

    layer = {"w13": rand(num_experts, 2 * inter, hidden, scale=hidden**-0.5),
             "w2": rand(num_experts, hidden, inter, scale=inter**-0.5), "s13": None, "s2": None}
    if shared:
        layer.update(s13=rand(2 * inter, hidden, scale=hidden**-0.5), s2=rand(hidden, inter, scale=inter**-0.5))
    return layer


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="JSON file to write (default: print it)")
    parser.add_argument("--budget-s", type=float, default=150.0, help="stop sweeping after this many seconds")
    parser.add_argument("--quick", action="store_true", help="two candidates per block_m, every other M")
    parser.add_argument("--shapes", nargs="*", default=list(SHAPES), choices=list(SHAPES))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    started = time.perf_counter()
    device = torch.device("cuda", torch.cuda.current_device())
    previous = t_fused.load_table(t_fused.device_name(device))
    ms_list = MS[::2] + ([MS[-1]] if len(MS) % 2 == 0 else []) if args.quick else MS
    table: dict = {"_comment": f"Tuned by scripts/gpu_moe_tune.py on {torch.cuda.get_device_name()}. Key: E (experts "
                               "incl. the shared one), H, I (one expert's intermediate width), k (ids columns, incl. "
                               "the shared one), dtype; then M = tokens in the call (the nearest M at or above wins)."}
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    summary = []
    for n, name in enumerate(args.shapes):
        shape = SHAPES[name]
        num_experts, hidden, inter, top_k, shared = shape
        key = t_fused.shape_key(num_experts + shared, hidden, inter, top_k + shared, DTYPE)
        # each shape gets an equal share of what is left of the budget
        share = (args.budget_s - (time.perf_counter() - started)) / (len(args.shapes) - n)
        sweep = Sweep(time.perf_counter() + share, args.quick)
        layer = make_layer(num_experts, hidden, inter, shared, gen)
        entries = {}
        print(f"{name} ({key}), {share:.0f} s", flush=True)
        for tokens in ms_list:
            cfg = None if sweep.out_of_time() else sweep.tune_m(layer, shape, tokens, gen)
            source = "tuned"
            if cfg is None:
                cfg = previous.get(key, {}).get(tokens) or t_fused.heuristic_config(num_experts + shared,
                                                                                    top_k + shared, tokens)
                source = "previous" if previous.get(key, {}).get(tokens) else "heuristic"
                sweep.skipped.append(f"{name} M={tokens}")
            try:
                err = validate(layer, shape, tokens, cfg, gen)
            except Exception as exc:  # noqa: BLE001  (the heuristic's shape may not fit this GPU)
                print(f"  M={tokens}: could not validate ({type(exc).__name__}: {str(exc)[:100]})", flush=True)
                err = 0.0
            if err > 2e-2:
                print(f"  M={tokens}: chosen config differs from the heuristic's output by {err:.2e}; dropped")
                cfg, source = t_fused.heuristic_config(num_experts + shared, top_k + shared, tokens), "heuristic"
            entries[str(tokens)] = cfg.to_json()
            summary.append((name, tokens, source, cfg, err))
        if args.quick:  # M values not swept take the next swept M's entry
            for tokens in MS:
                if str(tokens) not in entries:
                    above = [m for m in ms_list if m >= tokens]
                    entries[str(tokens)] = entries[str(min(above) if above else max(ms_list))]
        table[key] = {str(m): entries[str(m)] for m in MS}
        del layer
        torch.cuda.empty_cache()

    print(f"\n{'shape':17} {'M':>5} {'source':9} {'bm':>3} {'gate_up (N,K,G,w,s)':22} {'down (N,K,G,w,s)':22} check")
    for name, tokens, source, cfg, err in summary:
        gu, dn = cfg.gate_up, cfg.down
        print(f"{name:17} {tokens:>5} {source:9} {cfg.block_m:>3} "
              f"{str((gu.BLOCK_N, gu.BLOCK_K, gu.GROUP_M, gu.num_warps, gu.num_stages)):22} "
              f"{str((dn.BLOCK_N, dn.BLOCK_K, dn.GROUP_M, dn.num_warps, dn.num_stages)):22} {err:.1e}")
    text = json.dumps(table, indent=1) + "\n"
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
        print(f"wrote {args.out}")
    else:
        print(text)
    skipped = sum(1 for s in summary if s[2] != "tuned")
    print(f"{skipped} M values not tuned; {time.perf_counter() - started:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
