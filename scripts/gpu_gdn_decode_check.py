#!/usr/bin/env python3
"""Gated DeltaNet's fused decode mixer (one Triton launch) against its reference and the old chain.

For the linear-attention shapes of Qwen3.6-27B (16 key heads, 48 value heads) and
Qwen3.6-35B-A3B (16 / 32), head dims 128, and of ``ninfer-train``'s ``gpu-deep`` preset
(4 / 8, head dims 64; ``--shapes`` picks), conv kernel 4, bf16, at decode batch 1 and 8,
batch 8 with a graph padding row (negative slot), one sequence of 4 tokens as a chunk,
and the verify op itself (``gated_delta_verify``: 4 tokens, each state to its own row):

* relative error ||out - ref|| / ||ref|| of :func:`ninfer_kernels.triton.gated_delta_decode`
  against the torch reference (same dtype, the chain it is defined by), of the float32
  states, and whether the conv history matches exactly;
* CUDA-graph replay times of the fused kernel at its default launch shape and at each
  (warps, value splits) of ``VARIANTS``, and of the chain the
  layer ran before it (Triton conv, torch gate ops, the recurrent Triton delta rule,
  GatedRMSNorm's torch ops), with the bytes the step must move at least (float32 state
  read and written, conv history read and written, the projection rows, the output) and
  the bandwidth that implies. State reads come from HBM: do_bench clears L2 between calls.

One JSON object per line goes to ``--out``; a table goes to stdout.

    python3 scripts/gpu_gdn_decode_check.py --out gdn_decode.jsonl
    python3 scripts/gpu_gdn_decode_check.py --out gdn_small.jsonl --shapes train-gpu-deep
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback

import torch
import torch.nn.functional as F

from gpu_timing import Report, bench, graphed, rel_err  # noqa: E402 (scripts/ is on sys.path)
from ninfer.model.forward_batch import ForwardBatch
from ninfer_kernels import gated_delta_decode as ref
from ninfer_kernels.triton import causal_conv as t_conv
from ninfer_kernels.triton import gated_delta as t_delta
from ninfer_kernels.triton import gated_delta_decode as t_fused
from ninfer_plugins.models.hybrid_norms import GatedRMSNorm

#: name -> (key heads, value heads, head dim: Dk = Dv)
SHAPES = {"qwen3.6-27b": (16, 48, 128), "qwen3.6-35b-a3b": (16, 32, 128), "train-gpu-deep": (4, 8, 64)}
CONV_K, EPS = 4, 1e-6
DTYPE = torch.bfloat16
#: name -> ((tokens already processed, new tokens), state slot) per sequence
CASES = {
    "decode b=1": [((4095, 1), 0)],
    "decode b=8": [((4095, 1), i) for i in range(8)],
    "decode b=8 pad": [((4095, 1), i) for i in range(7)] + [((0, 1), -1)],
    "chunk b=1 x4": [((4095, 4), 0)],
}
#: (warps, programs per value head) timed beside the default launch shape (8 programs a
#: head only for heads narrower than 128: launch_shape keeps 32 columns a program)
VARIANTS = [(w, n) for n in (1, 2, 4, 8) for w in (1, 2, 4, 8)]
MAX_REL_ERR = 2e-2  # bf16 inputs and outputs, float32 state


def make_batch(case: list) -> ForwardBatch:
    """Only the fields the recurrent ops read matter; the KV fields are placeholders."""
    q_lens = [n for (_, n), _ in case]
    seq_lens = [c + n for (c, n), _ in case]
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    return ForwardBatch(
        query_start=starts.cuda(), seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device="cuda"),
        block_tables=torch.zeros(len(case), 1, dtype=torch.int32, device="cuda"),
        slot_mapping=torch.full((sum(q_lens),), -1, dtype=torch.int64, device="cuda"),
        logits_indices=starts[1:].cuda().long() - 1, block_size=16, max_query_len=max(q_lens),
        max_seq_len=max(seq_lens), query_lens_host=q_lens, seq_lens_host=seq_lens,
        state_slots=torch.tensor([s for _, s in case], dtype=torch.int64, device="cuda"),
    )


def make_inputs(hk: int, hv: int, D: int, tokens: int, num_slots: int, gen: torch.Generator) -> dict:
    """Random operands at checkpoint-like scales; A_log as Qwen initialises it (log U(1, 16))."""
    conv_dim = 2 * hk * D + hv * D
    width = conv_dim + hv * D + 2 * hv
    return {
        "proj": torch.randn(tokens, width, generator=gen).to("cuda", DTYPE),
        "conv_weight": (torch.randn(conv_dim, 1, CONV_K, generator=gen) * 0.3).to("cuda", DTYPE),
        "conv_states": torch.randn(num_slots, CONV_K - 1, conv_dim, generator=gen).to("cuda", DTYPE),
        "ssm_states": (torch.randn(num_slots, hv, D, D, generator=gen) * 0.1).cuda(),
        "a_log": torch.empty(hv).uniform_(1, 16, generator=gen).log().to("cuda", DTYPE),
        "dt_bias": torch.ones(hv, dtype=DTYPE, device="cuda"),
        "norm_weight": (1 + 0.1 * torch.randn(D, generator=gen)).to("cuda", DTYPE),
        "hk": hk,
        "d": D,
    }


def fused(x: dict, batch: ForwardBatch, num_warps: int | None = None, value_splits: int | None = None):
    def run():
        return t_fused.gated_delta_decode(x["proj"], x["conv_weight"], x["conv_states"], x["ssm_states"], x["a_log"],
                                          x["dt_bias"], x["norm_weight"], EPS, x["hk"], x["d"], batch, num_warps=num_warps,
                                          value_splits=value_splits)
    return run


def reference(x: dict, batch: ForwardBatch):
    return lambda: ref.gated_delta_decode(x["proj"], x["conv_weight"], x["conv_states"], x["ssm_states"], x["a_log"],
                                          x["dt_bias"], x["norm_weight"], EPS, x["hk"], x["d"], batch)


def old_chain(x: dict, batch: ForwardBatch):
    """What plugins/models/gated_deltanet.py ran per decode step before the fused op, minus the
    projections. (Its kernels index the pools by slot unchecked: no negative slots here.)"""
    hk, hv, D = x["hk"], x["a_log"].shape[0], x["d"]
    norm = GatedRMSNorm(D, EPS).cuda()
    norm.weight.data = x["norm_weight"]

    def run():
        proj = x["proj"]
        tokens = proj.shape[0]
        qkv, z, b, a = proj.split([2 * hk * D + hv * D, hv * D, hv, hv], dim=-1)
        qkv = t_conv.causal_conv1d(qkv, x["conv_weight"][:, 0], x["conv_states"], batch)
        q, k, v = qkv.split([hk * D, hk * D, hv * D], dim=-1)
        beta = b.sigmoid()
        g = -x["a_log"].float().exp() * F.softplus(a.float() + x["dt_bias"])
        out = t_delta.recurrent_gated_delta_rule(q.reshape(tokens, hk, D), k.reshape(tokens, hk, D),
                                                 v.reshape(tokens, hv, D), g, beta, x["ssm_states"], batch)
        return norm(out.reshape(-1, D), z.reshape(-1, D)).reshape(tokens, hv * D)
    return run


def min_bytes(hk: int, hv: int, D: int, case: list) -> int:
    """What a step must move: state and conv history in and out per live sequence (a padding
    one reads none and writes none), the projection rows in, the output rows out."""
    conv_dim = 2 * hk * D + hv * D
    tokens = sum(n for (_, n), _ in case)
    live = sum(s >= 0 for _, s in case)
    item = DTYPE.itemsize
    state = live * hv * D * D * 4 * 2
    history = live * (CONV_K - 1) * conv_dim * item * 2
    rows = tokens * (conv_dim + hv * D + 2 * hv) * item + tokens * hv * D * item
    return state + history + rows


def with_fresh_states(x: dict) -> dict:
    return {**x, "conv_states": x["conv_states"].clone(), "ssm_states": x["ssm_states"].clone()}


def judge(row: dict) -> bool | None:
    if "rel_err" not in row:
        return None
    return max(row["rel_err"], row.get("state_rel_err", 0.0)) <= MAX_REL_ERR and row.get("conv_exact", True)


def time_each(report: Report, base: dict, timed: dict, nbytes: int) -> None:
    """Replay each of ``timed`` from a CUDA graph; a launch shape that does not compile is a result too."""
    for name, fn in timed.items():
        try:
            ms = bench(graphed(fn))
            report.add({**base, "impl": name, "us": ms * 1e3, "bytes": nbytes, "gb_per_s": nbytes / ms / 1e6})
        except Exception as exc:  # noqa: BLE001
            report.add({**base, "impl": name, "error": f"{type(exc).__name__}: {exc}"[:300]})


def check_case(report: Report, shape: str, case_name: str, gen: torch.Generator) -> None:
    hk, hv, D = SHAPES[shape]
    case = CASES[case_name]
    batch = make_batch(case)
    x = make_inputs(hk, hv, D, sum(n for (_, n), _ in case), len(case), gen)
    base = {"shape": shape, "case": case_name}
    nbytes = min_bytes(hk, hv, D, case)

    want_x = with_fresh_states(x)
    want = reference(want_x, batch)()
    for splits in (1, 4):  # both norm paths: in the program, and by the head's last program
        split_x = with_fresh_states(x)
        split = fused(split_x, batch, value_splits=splits)()
        report.add({**base, "impl": f"fused s{splits}", "rel_err": rel_err(split, want),
                    "state_rel_err": rel_err(split_x["ssm_states"][[s for _, s in case if s >= 0]],
                                             want_x["ssm_states"][[s for _, s in case if s >= 0]]),
                    "conv_exact": torch.equal(split_x["conv_states"], want_x["conv_states"])})
    got_x = with_fresh_states(x)
    got = fused(got_x, batch)()
    live = [s for _, s in case if s >= 0]
    unused = [s for s in range(len(case)) if s not in live]  # the slot a padding row would have had
    untouched = all(torch.equal(got_x[key][unused], x[key][unused]) for key in ("conv_states", "ssm_states"))
    padded = len(live) < len(case)
    report.add({**base, "impl": "fused", "rel_err": rel_err(got, want),
                "state_rel_err": rel_err(got_x["ssm_states"][live], want_x["ssm_states"][live]),
                "conv_exact": torch.equal(got_x["conv_states"], want_x["conv_states"]) and untouched})
    if not padded:
        chain_x = with_fresh_states(x)
        chain = old_chain(chain_x, batch)()
        report.add({**base, "impl": "old_chain", "rel_err": rel_err(chain, want),
                    "state_rel_err": rel_err(chain_x["ssm_states"], want_x["ssm_states"])})

    # replayed graph == eager, from the same starting states
    replay_x = with_fresh_states(x)
    held = {}
    step = fused(replay_x, batch)
    replay = graphed(lambda: held.update(out=step()))  # held["out"]: the graph's output tensor
    for key in ("conv_states", "ssm_states"):  # warm-up and capture ran it: start over
        replay_x[key].copy_(x[key])
    replay()
    torch.cuda.synchronize()
    report.add({**base, "impl": "fused graph", "replay_equals_eager": bool(
        torch.equal(held["out"], got) and torch.equal(replay_x["ssm_states"], got_x["ssm_states"])
        and torch.equal(replay_x["conv_states"], got_x["conv_states"]))})

    warps, splits = t_fused.launch_shape(len(case), hv, D, torch.device("cuda"))
    timed = {f"default w{warps} s{splits}": fused(with_fresh_states(x), batch)}
    timed.update({f"fused w{w} s{n}": fused(with_fresh_states(x), batch, w, n) for w, n in VARIANTS if n < 8 or D < 128})
    if not padded:
        timed["old_chain"] = old_chain(with_fresh_states(x), batch)
    time_each(report, base, timed, nbytes)


def check_verify(report: Report, shape: str, gen: torch.Generator, width: int = 4) -> None:
    """``gated_delta_verify`` (speculative verify rows: each token's state to its own row) for
    one sequence of ``width`` tokens after 4,095: against the reference, then timed at the
    default launch shape and every variant."""
    hk, hv, D = SHAPES[shape]
    case = [((4095, width), 0)]
    batch = make_batch(case)
    x = make_inputs(hk, hv, D, width, 1 + width, gen)
    rows = torch.arange(1, 1 + width, dtype=torch.int64, device="cuda").view(1, width)
    base = {"shape": shape, "case": f"verify rows x{width}"}

    def op(module, y, **launch):
        return lambda: module.gated_delta_verify(y["proj"], y["conv_weight"], y["conv_states"], y["ssm_states"],
                                                 y["a_log"], y["dt_bias"], y["norm_weight"], EPS, hk, D, batch, rows,
                                                 **launch)

    want_x, got_x = with_fresh_states(x), with_fresh_states(x)
    want, got = op(ref, want_x)(), op(t_fused, got_x)()
    report.add({**base, "impl": "verify", "rel_err": rel_err(got, want),
                "state_rel_err": rel_err(got_x["ssm_states"][1:], want_x["ssm_states"][1:]),
                "conv_exact": torch.equal(got_x["conv_states"], want_x["conv_states"])})
    # the bytes it must move: the slot's state read, each position's state and history written
    nbytes = (1 + width) * hv * D * D * 4 + got.numel() * got.element_size() * 2
    warps, splits = t_fused.launch_shape(1, hv, D, torch.device("cuda"))
    timed = {f"default s{splits}": op(t_fused, with_fresh_states(x))}
    timed.update({f"verify w{w} s{n}": op(t_fused, with_fresh_states(x), num_warps=w, value_splits=n)
                  for w, n in VARIANTS if n < 8 or D < 128})
    time_each(report, base, timed, nbytes)


def table(report: Report) -> None:
    print(f"\n{'shape':17} {'case':15} {'impl':16} {'rel_err':>9} {'us':>8} {'GB/s':>7}")
    for r in report.rows:
        if "shape" not in r or "replay_equals_eager" in r:
            continue
        err = f"{r['rel_err']:.2e}" if "rel_err" in r else ""
        us = f"{r['us']:.2f}" if "us" in r else ("ERR" if "error" in r else "")
        bw = f"{r['gb_per_s']:.0f}" if "gb_per_s" in r else ""
        print(f"{r['shape']:17} {r['case']:15} {r['impl']:16} {err:>9} {us:>8} {bw:>7}")
    replays = [r for r in report.rows if "replay_equals_eager" in r]
    print(f"graph replay == eager: {sum(r['replay_equals_eager'] for r in replays)}/{len(replays)}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON-lines file to write")
    parser.add_argument("--shapes", default="qwen3.6-27b,qwen3.6-35b-a3b", help=f"of {', '.join(SHAPES)}")
    parser.add_argument("--cases", default=",".join([*CASES, "verify"]),
                        help="comma-separated, of: " + ", ".join([*CASES, "verify"]) + " (default: all)")
    args = parser.parse_args()
    cases = args.cases.split(",")
    if set(cases) - {*CASES, "verify"}:
        parser.error(f"unknown cases: {', '.join(sorted(set(cases) - {*CASES, 'verify'}))}")
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    started = time.perf_counter()
    report = Report(args.out, judge)
    report.add({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                "default_num_warps": t_fused.NUM_WARPS, "target_programs": t_fused.TARGET_PROGRAMS,
                "many_programs": t_fused.MANY_PROGRAMS})
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for shape in args.shapes.split(","):
            for case_name in (c for c in CASES if c in cases):
                try:
                    check_case(report, shape, case_name, gen)
                except Exception as exc:  # noqa: BLE001  (report and go on to the next case)
                    traceback.print_exc()
                    report.add({"shape": shape, "case": case_name, "error": f"{type(exc).__name__}: {exc}"[:300]})
            try:
                if "verify" in cases:
                    check_verify(report, shape, gen)
            except Exception as exc:  # noqa: BLE001
                traceback.print_exc()
                report.add({"shape": shape, "case": "verify rows", "error": f"{type(exc).__name__}: {exc}"[:300]})
    table(report)
    replays_bad = sum(1 for r in report.rows if r.get("replay_equals_eager") is False)
    print(f"{report.failed + replays_bad} failed; {time.perf_counter() - started:.0f} s", flush=True)
    return 1 if report.failed or replays_bad else 0


if __name__ == "__main__":
    sys.exit(main())
