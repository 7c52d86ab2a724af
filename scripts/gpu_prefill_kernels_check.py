#!/usr/bin/env python3
"""Gated DeltaNet's prefill conv and gated RMSNorm at Qwen3.6-27B / Qwen3.6-35B-A3B shapes.

For 2k and 8k tokens (bf16), and a continued chunk, a mixed batch and a decode batch for
the conv: relative error ||out - ref|| / ||ref|| against the torch references, whether the
conv's state slots equal the reference's, and median times with bytes moved and GB/s of

* the token-parallel Triton conv (a few block sizes) against the previous kernel, which
  walked each sequence's tokens in one program (copied here as the baseline);
* the one-pass Triton gated norm against the torch ops of ``GatedRMSNorm.forward`` as the
  model calls them (``z.reshape(-1, Dv)`` included: that copies the strided gate).

One JSON object per line goes to ``--out``; a table goes to stdout at the end.

    python3 scripts/gpu_prefill_kernels_check.py --out prefill_kernels.jsonl
"""

from __future__ import annotations

import argparse
import sys

import torch
import triton
import triton.language as tl

from gpu_timing import Report, bench, rel_err  # noqa: E402 (scripts/ is on sys.path)
from ninfer.model.forward_batch import ForwardBatch
from ninfer_kernels import causal_conv
from ninfer_kernels.gated_rms_norm import gated_rms_norm
from ninfer_kernels.triton import causal_conv as t_conv
from ninfer_kernels.triton import gated_rms_norm as t_norm

#: name -> (conv channels 2*Hk*Dk + Hv*Dv, value heads); Hk = 16, Dk = Dv = 128
SHAPES = {"27B": (2 * 16 * 128 + 48 * 128, 48), "35B-A3B": (2 * 16 * 128 + 32 * 128, 32)}
DV, CONV_K, DTYPE, EPS, DEVICE = 128, 4, torch.bfloat16, 1e-6, "cuda"
MAX_REL_ERR = 1e-2
#: (block_t, block_c, num_warps) tried for the new conv; the first is the default
CONV_CONFIGS = [(t_conv.BLOCK_T, t_conv.BLOCK_C, 4), (32, 128, 4), (64, 128, 8), (64, 256, 8), (128, 128, 8)]


@triton.jit
def _token_loop_kernel(
    x_ptr, w_ptr, state_ptr, out_ptr, starts_ptr, seq_lens_ptr, slots_ptr,
    channels, stride_x, stride_w, stride_slot, stride_hist, stride_out,
    K: tl.constexpr, KP: tl.constexpr, BLOCK: tl.constexpr,
):
    """The previous kernel: one program per (sequence, 128 channels) walks the tokens in order."""
    seq = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    col_ok = cols < channels
    start = tl.load(starts_ptr + seq).to(tl.int64)
    end = tl.load(starts_ptr + seq + 1).to(tl.int64)
    cached = tl.load(seq_lens_ptr + seq) - (end - start)
    state = state_ptr + tl.load(slots_ptr + seq).to(tl.int64) * stride_slot
    taps = tl.arange(0, KP)
    has_history = (taps * 0 + cached) > 0
    tap_ok = taps < K
    w = tl.load(w_ptr + cols[:, None] * stride_w + taps[None, :], mask=col_ok[:, None] & tap_ok[None, :], other=0.0)
    w = w.to(tl.float32)
    for t in range(start, end):
        pos = t - (K - 1) + taps
        in_x = pos >= start
        hist = K - 1 + pos - start
        xv = tl.load(x_ptr + pos[None, :] * stride_x + cols[:, None],
                     mask=col_ok[:, None] & (tap_ok & in_x)[None, :], other=0.0)
        sv = tl.load(state + hist[None, :] * stride_hist + cols[:, None],
                     mask=col_ok[:, None] & (tap_ok & ~in_x & (hist >= 0) & has_history)[None, :], other=0.0)
        acc = tl.sum((xv.to(tl.float32) + sv.to(tl.float32)) * w, axis=1)
        out = acc / (1.0 + tl.exp(-acc))
        tl.store(out_ptr + t * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=col_ok)
    rows = tl.arange(0, KP)
    row_ok = rows < K - 1
    pos = end - (K - 1) + rows
    in_x = pos >= start
    hist = K - 1 + pos - start
    xv = tl.load(x_ptr + pos[None, :] * stride_x + cols[:, None],
                 mask=col_ok[:, None] & (row_ok & in_x)[None, :], other=0.0)
    sv = tl.load(state + hist[None, :] * stride_hist + cols[:, None],
                 mask=col_ok[:, None] & (row_ok & ~in_x & has_history)[None, :], other=0.0)
    tl.debug_barrier()
    new = xv.to(state_ptr.dtype.element_ty) + sv
    tl.store(state + rows[None, :] * stride_hist + cols[:, None], new, mask=col_ok[:, None] & row_ok[None, :])


def token_loop_conv(x, weight, states, batch):
    out = torch.zeros(x.shape, dtype=x.dtype, device=x.device)
    channels, k = weight.shape
    _token_loop_kernel[(batch.num_seqs, triton.cdiv(channels, 128))](
        x, weight, states, out, batch.query_start, batch.seq_lens, batch.state_slots,
        channels, x.stride(0), weight.stride(0), states.stride(0), states.stride(1), out.stride(0),
        K=k, KP=triton.next_power_of_2(k), BLOCK=128, num_warps=4,
    )
    return out


def make_batch(specs: list[tuple[int, int]]) -> ForwardBatch:
    """(tokens already processed, new tokens) per sequence, sequence i in slot i: the fields the conv reads."""
    q_lens = [n for _, n in specs]
    seq_lens = [c + n for c, n in specs]
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    return ForwardBatch(
        query_start=starts.to(DEVICE), seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        block_tables=torch.zeros(len(specs), 1, dtype=torch.int32, device=DEVICE),
        slot_mapping=torch.full((sum(q_lens),), -1, dtype=torch.int64, device=DEVICE),
        logits_indices=starts[1:].to(DEVICE).long() - 1, block_size=16, max_query_len=max(q_lens),
        max_seq_len=max(seq_lens), query_lens_host=q_lens, seq_lens_host=seq_lens,
        state_slots=torch.arange(len(specs), dtype=torch.int64, device=DEVICE),
    )


def judge(row: dict) -> bool | None:
    if "rel_err" not in row:
        return None
    return row["rel_err"] <= MAX_REL_ERR and row.get("states_equal", True)


def _timed(report: Report, base: dict, fn, nbytes: int, rep: int = 50) -> float:
    ms = bench(fn, rep=rep)
    report.add({**base, "ms": ms, "bytes": nbytes, "gb_per_s": nbytes / ms / 1e6})
    return ms


def check_conv(report: Report, shape: str, case: str, specs: list[tuple[int, int]], gen: torch.Generator) -> None:
    channels, _ = SHAPES[shape]
    batch = make_batch(specs)
    tokens = sum(n for _, n in specs)
    # the conv reads a column slice of the input projection (q | k | v | z | b | a)
    proj = torch.randn(tokens, channels + 6144, generator=gen).to(DEVICE, DTYPE)
    x = proj[:, :channels]
    weight = (torch.randn(channels, CONV_K, generator=gen) * 0.3).to(DEVICE, DTYPE)
    states0 = torch.randn(len(specs), CONV_K - 1, channels, generator=gen).to(DEVICE, DTYPE)
    want_states = states0.clone()
    want = causal_conv.causal_conv1d(x, weight, want_states, batch)
    base = {"kernel": "causal_conv1d", "shape": shape, "case": case, "tokens": tokens}
    nbytes = 2 * tokens * channels * x.element_size() + 2 * states0[:1].nbytes * len(specs)
    scratch = states0.clone()
    for block_t, block_c, warps in CONV_CONFIGS:
        got_states = states0.clone()
        got = t_conv.causal_conv1d(x, weight, got_states, batch, block_t=block_t, block_c=block_c, num_warps=warps)
        report.add({**base, "impl": f"token_parallel t{block_t} c{block_c} w{warps}", "rel_err": rel_err(got, want),
                    "states_equal": bool(torch.equal(got_states, want_states))})
        _timed(report, {**base, "impl": f"token_parallel t{block_t} c{block_c} w{warps}"},
               lambda: t_conv.causal_conv1d(x, weight, scratch, batch, block_t=block_t, block_c=block_c, num_warps=warps), nbytes)
    got_states = states0.clone()
    got = token_loop_conv(x, weight, got_states, batch)
    report.add({**base, "impl": "token_loop (old)", "rel_err": rel_err(got, want),
                "states_equal": bool(torch.equal(got_states, want_states))})
    _timed(report, {**base, "impl": "token_loop (old)"}, lambda: token_loop_conv(x, weight, scratch, batch), nbytes,
           rep=20)


def check_norm(report: Report, shape: str, tokens: int, gen: torch.Generator) -> None:
    channels, heads = SHAPES[shape]
    value_dim = heads * DV
    x = torch.randn(tokens, heads, DV, generator=gen).to(DEVICE, DTYPE)  # the delta rule's output
    proj = torch.randn(tokens, channels + value_dim + 2 * heads, generator=gen).to(DEVICE, DTYPE)
    z = proj[:, channels : channels + value_dim]  # the gate: a column slice of the projection
    weight = (torch.rand(DV, generator=gen) + 0.5).to(DEVICE, DTYPE)
    want = gated_rms_norm(x.reshape(-1, DV), z.reshape(-1, DV), weight, EPS)
    base = {"kernel": "gated_rms_norm", "shape": shape, "case": f"prefill {tokens // 1024}k", "tokens": tokens}
    nbytes = 3 * x.numel() * x.element_size()  # read x and the gate, write the output
    got = t_norm.gated_rms_norm(x, z.unflatten(-1, (heads, DV)), weight, EPS)
    report.add({**base, "impl": "triton", "rel_err": rel_err(got.reshape(-1, DV), want)})
    _timed(report, {**base, "impl": "triton"},
           lambda: t_norm.gated_rms_norm(x, z.unflatten(-1, (heads, DV)), weight, EPS), nbytes)
    _timed(report, {**base, "impl": "torch ops (module)"},
           lambda: gated_rms_norm(x.reshape(-1, DV), z.reshape(-1, DV), weight, EPS), nbytes)


def table(rows: list[dict]) -> str:
    timed = [r for r in rows if "ms" in r]
    errs = {(r["kernel"], r["shape"], r["case"], r["impl"]): r for r in rows if "rel_err" in r}
    lines = [f"{'kernel':<15} {'shape':<8} {'case':<22} {'impl':<28} {'ms':>8} {'GB/s':>7} {'rel_err':>9} ok"]
    for r in timed:
        e = errs.get((r["kernel"], r["shape"], r["case"], r["impl"]), {})
        lines.append(f"{r['kernel']:<15} {r['shape']:<8} {r['case']:<22} {r['impl']:<28} {r['ms']:>8.4f} "
                     f"{r['gb_per_s']:>7.0f} {e.get('rel_err', float('nan')):>9.2e} {e.get('ok', '')}")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON-lines file to write")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    report = Report(args.out, judge)
    report.add({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__})
    gen = torch.Generator().manual_seed(0)
    conv_cases = {"prefill 2k": [(0, 2048)], "prefill 8k": [(0, 8192)], "chunk 2k after 6k": [(6144, 2048)],
                  "mixed 2k + 31 decode": [(0, 2048)] + [(4095, 1)] * 31, "decode b=64": [(4095, 1)] * 64}
    with torch.inference_mode():
        for shape in SHAPES:
            for case, specs in conv_cases.items():
                check_conv(report, shape, case, specs, gen)
            for tokens in (2048, 8192):
                check_norm(report, shape, tokens, gen)
    torch.cuda.synchronize()
    print(table(report.rows))
    print(f"{report.failed} failed", flush=True)
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
