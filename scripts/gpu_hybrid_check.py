#!/usr/bin/env python3
"""Gated DeltaNet kernels and one hybrid layer at Qwen3.6-27B shapes on one CUDA GPU.

Kernels (our Triton conv and recurrent delta rule, and flash-linear-attention's chunked
delta rule when it imports) are checked against the torch references: relative error
||out - ref|| / ||ref|| of the outputs and of the updated state slots, with median times.
Then one Gated DeltaNet layer and one gated-attention layer (each with its 17408-wide
MLP and norms, bf16, random weights) are timed for prefill 2k / 8k and decode at batch
1 / 8 over a 4k context, eagerly and, for decode, replayed from a CUDA graph.
One JSON object per line goes to ``--out``; a summary goes to stdout.

    python3 scripts/gpu_hybrid_check.py --out hybrid.jsonl
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from gpu_timing import Report, bench, graphed, rel_err  # noqa: E402 (scripts/ is on sys.path)
from ninfer.model.forward_batch import ForwardBatch
from ninfer.plugins import load_registry
from ninfer_kernels import causal_conv, gated_delta
from ninfer_kernels.triton import causal_conv as t_conv
from ninfer_kernels.triton import gated_delta as t_delta
from ninfer_plugins.models.hybrid_decoder import build_hybrid

#: Qwen3.6-27B's text decoder (public config.json), cut to one linear and one full layer
CONFIG = {
    "model_type": "qwen3_5_text", "vocab_size": 1024, "hidden_size": 5120, "intermediate_size": 17408,
    "num_hidden_layers": 4, "num_attention_heads": 24, "num_key_value_heads": 4, "head_dim": 256,
    "linear_num_key_heads": 16, "linear_num_value_heads": 48, "linear_key_head_dim": 128,
    "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "full_attention_interval": 4,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
    "max_position_embeddings": 16384, "rms_norm_eps": 1e-6,
}
HK, HV, DK, DV, CONV_K = 16, 48, 128, 128, 4
CONV_DIM = 2 * HK * DK + HV * DV
PAGE = 16
DTYPE = torch.bfloat16
MAX_REL_ERR = 2e-2  # bf16 inputs, float32 state


def make_batch(specs: list[tuple[int, int]]) -> ForwardBatch:
    """(tokens already processed, new tokens) per sequence; sequence i owns slot i and pages after it."""
    q_lens = [n for _, n in specs]
    seq_lens = [c + n for c, n in specs]
    pages = [-(-s // PAGE) for s in seq_lens]
    tables = torch.zeros(len(specs), max(pages), dtype=torch.int32)
    slots, first = [], 0
    for i, ((cached, new), n) in enumerate(zip(specs, pages)):
        tables[i, :n] = torch.arange(first, first + n, dtype=torch.int32)
        slots += [first * PAGE + p for p in range(cached, cached + new)]
        first += n
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    return ForwardBatch(
        query_start=starts.cuda(), seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device="cuda"),
        block_tables=tables.cuda(), slot_mapping=torch.tensor(slots, dtype=torch.int64, device="cuda"),
        logits_indices=starts[1:].cuda().long() - 1, block_size=PAGE, max_query_len=max(q_lens),
        max_seq_len=max(seq_lens), query_lens_host=q_lens, seq_lens_host=seq_lens,
        state_slots=torch.arange(len(specs), dtype=torch.int64, device="cuda"),
    )


def judge(row: dict) -> bool | None:
    if "rel_err" not in row:
        return None
    return max(row["rel_err"], row.get("state_rel_err", 0.0)) <= MAX_REL_ERR


def check_kernels(report: Report, case: str, specs: list[tuple[int, int]], gen: torch.Generator) -> None:
    batch = make_batch(specs)
    tokens = sum(n for _, n in specs)
    x = torch.randn(tokens, CONV_DIM, generator=gen).to("cuda", DTYPE)
    weight = (torch.randn(CONV_DIM, CONV_K, generator=gen) * 0.3).to("cuda", DTYPE)
    conv0 = torch.randn(len(specs), CONV_K - 1, CONV_DIM, generator=gen).to("cuda", DTYPE)
    want_states, got_states = conv0.clone(), conv0.clone()
    want = causal_conv.causal_conv1d(x, weight, want_states, batch)
    got = t_conv.causal_conv1d(x, weight, got_states, batch)
    ms = bench(lambda: t_conv.causal_conv1d(x, weight, conv0.clone(), batch))
    report.add({"kernel": "causal_conv1d", "case": case, "rel_err": rel_err(got, want),
                "state_rel_err": rel_err(got_states, want_states), "ms": ms})

    q, k = (torch.randn(tokens, HK, DK, generator=gen).to("cuda", DTYPE) for _ in range(2))
    v = torch.randn(tokens, HV, DV, generator=gen).to("cuda", DTYPE)
    g = (-torch.rand(tokens, HV, generator=gen) * 0.5).cuda()
    beta = torch.rand(tokens, HV, generator=gen).to("cuda", DTYPE)
    ssm0 = (torch.randn(len(specs), HV, DK, DV, generator=gen) * 0.1).cuda()
    want_states = ssm0.clone()
    want = gated_delta.gated_delta_rule(q, k, v, g, beta, want_states, batch)
    impls = {"recurrent_triton": t_delta.recurrent_gated_delta_rule}
    if t_delta.fla_chunk is not None:
        impls["fla_chunk"] = t_delta.chunked_gated_delta_rule
    for name, fn in impls.items():
        if name == "recurrent_triton" and tokens > 8192:
            continue  # one token at a time: correct but slow at this length
        got_states = ssm0.clone()
        got = fn(q, k, v, g, beta, got_states, batch)
        ms = bench(lambda: fn(q, k, v, g, beta, ssm0.clone(), batch), rep=20)
        report.add({"kernel": f"gated_delta_rule/{name}", "case": case, "rel_err": rel_err(got, want),
                    "state_rel_err": rel_err(got_states, want_states), "ms": ms})


def build_layers():
    """A Gated DeltaNet layer and a gated-attention layer of Qwen3.6-27B with random weights."""
    model = build_hybrid(CONFIG, DTYPE, "cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty_like(p).uniform_(1, 16, generator=gen).log())
            elif name.endswith("dt_bias") or "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0, 0.02, generator=gen)
    return model, model.model.layers[0], model.model.layers[3]


def time_layers(report: Report, model, linear, full, max_seqs: int) -> None:
    kv = load_registry().get("kv_dtype", "bf16")
    num_blocks = max_seqs * (-(-8192 // PAGE)) + 8
    model.bind_kv_caches([kv.allocate(num_blocks, PAGE, 4, 256, DTYPE, "cuda")])
    model.allocate_state(max_seqs, "cuda")
    cases = {"prefill 2k": [(0, 2048)], "prefill 8k": [(0, 8192)],
             "decode b=1 ctx=4k": [(4095, 1)], "decode b=8 ctx=4k": [(4095, 1)] * 8}
    for case, specs in cases.items():
        batch = make_batch(specs)
        tokens = sum(n for _, n in specs)
        x = torch.randn(tokens, CONFIG["hidden_size"], device="cuda", dtype=DTYPE)
        positions = torch.cat([torch.arange(c, c + n) for c, n in specs]).cuda()
        for kind, layer in (("gated_deltanet", linear), ("gated_attention", full)):
            def step(layer=layer):
                return layer(positions, x, x, batch, model.cos_sin)

            with torch.inference_mode():
                ms = bench(step, rep=20)
                row = {"layer": kind, "case": case, "tokens": tokens, "ms": ms, "tok_per_s": tokens / ms * 1e3}
                if tokens <= 8:
                    try:
                        row["graph_ms"] = bench(graphed(step))
                    except Exception as exc:  # noqa: BLE001  (report why it cannot be captured)
                        row["graph_error"] = f"{type(exc).__name__}: {exc}"[:200]
            report.add(row)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON-lines file to write")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    started = time.perf_counter()
    report = Report(args.out, judge)
    report.add({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                "fla": t_delta.fla_chunk is not None})
    gen = torch.Generator().manual_seed(0)
    for case, specs in {"decode b=1": [(4095, 1)], "decode b=8": [(4095, 1)] * 8,
                        "decode b=64": [(4095, 1)] * 64, "prefill 2k": [(0, 2048)],
                        "prefill 8k": [(0, 8192)], "chunk 2k after 6k": [(6144, 2048)],
                        "mixed 2k + 31 decode": [(0, 2048)] + [(4095, 1)] * 31}.items():
        check_kernels(report, case, specs, gen)
    model, linear, full = build_layers()
    time_layers(report, model, linear, full, max_seqs=8)
    torch.cuda.synchronize()
    print(f"{report.failed} failed; {time.perf_counter() - started:.0f} s", flush=True)
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
