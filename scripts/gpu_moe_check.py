#!/usr/bin/env python3
"""Fused MoE kernels at real shapes on one CUDA GPU: correctness, then speed.

For Qwen3.6-35B-A3B (256 experts + a shared one, H 2048, I 512, top 8) and
Qwen3-30B-A3B (128 experts, H 2048, I 768, top 8), bf16, random weights, T tokens:

* correctness: Triton ``moe_route`` ids/weights and ``moe_align`` layouts against the
  references (ids must match exactly, layouts bit for bit), and ``fused_moe`` against the
  reference (float32 matmuls on the same bf16 inputs), as ||out - ref|| / ||ref||;
* speed: route + fused_moe replayed from a CUDA graph for T <= 256 (as decode runs it),
  plain calls above; beside it the old path (softmax/top-k, ``expert_loop``'s
  per-expert loop, the shared MLP as its own matmuls), eager since it syncs. GB/s counts
  the weights of each distinct expert routed to, read once, plus the activations;
  TFLOP/s counts 6 * pairs * H * I.
* the align paths (one-CTA kernel, the four-launch grid) timed at each T (from a graph
  up to 256 tokens), to place ``moe_route.KERNEL_MAX_PAIRS``.

One JSON object per line goes to ``--out``; a table goes to stdout.

    python3 scripts/gpu_moe_check.py --out moe.jsonl
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.nn.functional as F

from gpu_timing import Report, bench, captured, rel_err  # noqa: E402 (scripts/ is on sys.path)
from ninfer_kernels import moe
from ninfer_kernels.triton import fused_moe as t_fused
from ninfer_kernels.triton import moe_route as t_route
from ninfer_kernels.triton.moe_align_grid import align_grid

#: name -> (routed experts, hidden, expert intermediate, top_k, shared expert)
#: routing weights: the shared expert's gate logit is rounded to bf16 as a linear layer's
#: output is, and a dot product summed in another order may land on the other side of a
#: rounding boundary (one bf16 step of the logit moves the sigmoid by up to ~1e-3)
ROUTE_W_TOL = 2e-3
SHAPES = {"qwen3.6-35b-a3b": (256, 2048, 512, 8, True), "qwen3-30b-a3b": (128, 2048, 768, 8, False)}
TOKENS = [1, 8, 64, 1024, 8192]
GRAPH_MAX_TOKENS = 256
DTYPE = torch.bfloat16
DEVICE = "cuda"  # (a CPU smoke test of the logic swaps it, with the timers)
MAX_REL_ERR = 2e-2


def make_layer(num_experts: int, hidden: int, inter: int, shared: bool, gen: torch.Generator) -> dict:
    def rand(*shape, scale):
        return (torch.randn(*shape, device=DEVICE, generator=gen, dtype=DTYPE) * scale)

    layer = {"router": rand(num_experts, hidden, scale=hidden**-0.5),
             "w13": rand(num_experts, 2 * inter, hidden, scale=hidden**-0.5),
             "w2": rand(num_experts, hidden, inter, scale=inter**-0.5),
             "s13": None, "s2": None, "gate": None}
    if shared:  # as the model stores them: Linear weights [out, in]
        layer.update(s13=rand(2 * inter, hidden, scale=hidden**-0.5), s2=rand(hidden, inter, scale=inter**-0.5),
                     gate=rand(1, hidden, scale=hidden**-0.5))
    return layer


def new_path(layer: dict, top_k: int):
    def run(x: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        w, ids = t_route.moe_route(logits, top_k, True, x, layer["gate"])
        return t_fused.fused_moe(x, layer["w13"], layer["w2"], w, ids, layer["s13"], layer["s2"])
    return run


def old_path(layer: dict, top_k: int):
    """What plugins/models/moe.py and shared_moe.py did before: one matmul pair per expert."""
    def run(x: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        w, ids = probs.topk(top_k, dim=-1)
        w = w / w.sum(dim=-1, keepdim=True)
        out = moe.expert_loop(x, w.to(x.dtype), ids, layer["w13"], layer["w2"])
        if layer["s13"] is not None:
            g, u = F.linear(x, layer["s13"]).float().chunk(2, dim=-1)
            shared = F.linear((F.silu(g) * u).to(x.dtype), layer["s2"])
            out = out + torch.sigmoid(F.linear(x, layer["gate"])) * shared
        return out
    return run


def moved_bytes(ids: torch.Tensor, hidden: int, inter: int) -> int:
    """Weights of each distinct expert once, x and the output, the two pair-row buffers."""
    experts = int(ids.unique().numel())
    tokens, pairs = ids.shape[0], ids.numel()
    el = torch.finfo(DTYPE).bits // 8
    return el * (experts * 3 * hidden * inter + 2 * tokens * hidden + 2 * pairs * inter + 2 * pairs * hidden)


def check_shape(report: Report, name: str, skip_ref_above: int, gen: torch.Generator) -> None:
    num_experts, hidden, inter, top_k, shared = SHAPES[name]
    layer = make_layer(num_experts, hidden, inter, shared, gen)
    new, old = new_path(layer, top_k), old_path(layer, top_k)
    total_experts, k_out = num_experts + shared, top_k + shared
    for tokens in TOKENS:
        x = torch.randn(tokens, hidden, device=DEVICE, generator=gen, dtype=DTYPE)
        logits = F.linear(x, layer["router"])
        row = {"shape": name, "T": tokens}
        # routing and layout
        want_w, want_ids = moe.moe_route(logits, top_k, True, x, layer["gate"])
        w, ids = t_route.moe_route(logits, top_k, True, x, layer["gate"])
        row["route_id_mismatch"] = int((ids != want_ids).sum())
        row["route_w_maxdiff"] = float((w - want_w).abs().max())
        cfg = t_fused.select_config(x.device, total_experts, hidden, inter, k_out, DTYPE, tokens)
        row["block_m"] = cfg.block_m
        want_layout = moe.moe_align(want_ids, total_experts, cfg.block_m)
        paths = {"grid": lambda: align_grid(want_ids, total_experts, cfg.block_m)}
        if want_ids.numel() <= 8 * t_route.KERNEL_MAX_PAIRS:  # one CTA's chunk loop: slow past that
            paths["kernel"] = lambda: t_route._align_kernel_launch(want_ids, total_experts, cfg.block_m)
        if want_ids.numel() <= t_route.SMALL_PAIRS:
            paths["small"] = lambda: t_route._align_small_launch(want_ids, total_experts, cfg.block_m)
        row["align_exact"] = all(torch.equal(a, b) for fn in paths.values() for a, b in zip(fn(), want_layout))
        for path, fn in paths.items():  # replayed from a graph where decode would be
            row[f"align_{path}_us"] = bench(captured(fn)[0] if tokens <= GRAPH_MAX_TOKENS else fn, rep=20) * 1e3
        # fused MoE on the reference's routing
        got = t_fused.fused_moe(x, layer["w13"], layer["w2"], want_w, want_ids, layer["s13"], layer["s2"])
        if tokens <= skip_ref_above:
            want = moe.fused_moe(x, layer["w13"], layer["w2"], want_w, want_ids, layer["s13"], layer["s2"])
            row["rel_err"] = rel_err(got, want)
        row["ok"] = (row["align_exact"] and row["route_id_mismatch"] == 0 and row["route_w_maxdiff"] <= ROUTE_W_TOL
                     and row.get("rel_err", 0.0) <= MAX_REL_ERR)
        # speed
        step = lambda: new(x, logits)  # noqa: E731
        if tokens <= GRAPH_MAX_TOKENS:
            eager_out = step()
            replay, graph_out = captured(step)
            replay()
            row["graph_equal"] = torch.equal(graph_out, eager_out)
            row["ok"] = row["ok"] and row["graph_equal"]
            row["new_us"] = bench(replay) * 1e3
            row["mode"] = "graph"
        else:
            row["new_us"] = bench(step, rep=50) * 1e3
            row["mode"] = "eager"
        with torch.inference_mode():
            row["old_us"] = bench(lambda: old(x, logits), rep=50) * 1e3
        row["speedup"] = row["old_us"] / row["new_us"]
        row["GB_s"] = moved_bytes(ids, hidden, inter) / (row["new_us"] * 1e-6) / 1e9
        row["TFLOP_s"] = 6 * ids.numel() * hidden * inter / (row["new_us"] * 1e-6) / 1e12
        report.add(row)
    del layer
    torch.cuda.empty_cache()


def print_table(rows: list[dict]) -> None:
    print(f"\n{'shape':17} {'T':>5} {'bm':>3} {'rel_err':>8} {'new us':>9} {'old us':>9} {'x':>6} {'GB/s':>7} "
          f"{'TFLOP/s':>8} {'align k/s us':>14} ok")
    for r in rows:
        if "T" not in r:
            continue
        err = f"{r['rel_err']:.1e}" if "rel_err" in r else "-"
        print(f"{r['shape']:17} {r['T']:>5} {r['block_m']:>3} {err:>8} {r['new_us']:>9.1f} {r['old_us']:>9.1f} "
              f"{r['speedup']:>6.2f} {r['GB_s']:>7.0f} {r['TFLOP_s']:>8.1f} "
              f"{r.get('align_small_us', r.get('align_kernel_us', float('nan'))):>6.1f}/{r['align_sorted_us']:<7.1f} {'ok' if r['ok'] else 'FAIL'}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON-lines file to write")
    parser.add_argument("--shapes", nargs="*", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--skip-ref-above", type=int, default=8192, help="no reference past this many tokens")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    torch.backends.cuda.matmul.allow_tf32 = False  # the reference's float32 matmuls stay float32
    started = time.perf_counter()
    report = Report(args.out)
    report.add({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                "triton": __import__("triton").__version__,
                "table": t_fused.device_name(torch.device("cuda")),
                "tuned_shapes": sorted(t_fused.load_table(t_fused.device_name(torch.device("cuda", 0))))})
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    for name in args.shapes:
        try:
            check_shape(report, name, args.skip_ref_above, gen)
        except Exception as exc:  # noqa: BLE001  (report it and go on to the next shape)
            report.add({"shape": name, "error": f"{type(exc).__name__}: {exc}"[:300], "ok": False})
    torch.cuda.synchronize()
    print_table(report.rows)
    print(f"{report.failed} failed; {time.perf_counter() - started:.0f} s", flush=True)
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
