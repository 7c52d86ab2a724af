"""Why the bench's two plain decode figures differ (#19's baseline question, GPU).

``ninfer-bench --spec ...`` prints two plain figures for the same model: ``decode`` (one
random prompt, on the first engine the process builds) and ``spec_decode`` with no
drafts (16 prompts decoded one after another and pooled, on a second engine built for
the spec sample). On an H100 the first stepped about 11% faster (sessions 34 and 36),
which moves #19's speedup between 1.99x and 2.23x. The suspects are the pooling (a
fuller prefix cache and snapshot pool in later requests), the second engine in the
process, and the text. This script times them apart, every figure at c=1 with steps
launched ahead (the bench's setting), one JSON line each:

1. engine A: one random prompt, then 16 random prompts pooled, then 16 text windows pooled;
2. engine B, built after A is freed: the same three;

each engine's batch-1 decode graph replayed back to back after them (the device's own step).

    python scripts/gpu_plain_gap.py random:train-gpu-deep --text some.txt
"""

from __future__ import annotations

import argparse
import gc
import json

import torch

from ninfer import LLM
from ninfer.bench import ninfer_runs, spec_decode
from ninfer.bench.figures import graph_replay_ms
from ninfer.bench.workload import fixed_workload
from ninfer.engine.builder import resolve_device, resolve_dtype
from ninfer.model.sources import resolve_source
from ninfer.plugins import load_registry


def build(model: str, args, **options) -> LLM:
    """An engine sized as the bench sizes its decode engine; ``options`` go to :class:`LLM`."""
    device = resolve_device(args.device)
    path, weights = resolve_source(model, load_registry(), resolve_dtype(args.dtype, device), device, 0)
    # the bench's engine for `--only decode --concurrency 1,8` as ninfer.bench.figures sizes it:
    # its context reaches the offline defaults' longest request (1,024 + 1,024 tokens) and its
    # KV holds eight of the decode requests
    longest = max(2048, args.prompt_len + args.output_len)
    return LLM(str(path), device=args.device, dtype=args.dtype, max_num_seqs=8, max_context=longest,
               kv_capacity=max(longest, 8 * (args.prompt_len + args.output_len)), weights=weights, **options)


def figures(llm: LLM, name: str, args) -> list[dict]:
    engine, tokenizer = llm.engine, llm.get_tokenizer()
    vocab = tokenizer.vocab_size
    text = spec_decode.prompt_ids(tokenizer, args.text)
    single = ninfer_runs.decode_throughput(engine, fixed_workload(1, args.prompt_len, args.output_len, vocab, 1))
    out = [{"engine": name, "sample": "one random prompt", **single}]
    for sample, ids in (("random prompts pooled", None), ("text windows pooled", text)):
        pooled, _ = spec_decode.measure(engine, ids, 1, args.prompt_len, args.output_len, vocab, 0)
        out.append({"engine": name, "sample": sample, **pooled})
    # the forward alone, replayed back to back: whether the device's own step differs between engines
    out.append({"engine": name, "sample": "batch-1 graph replayed", "step_ms": graph_replay_ms(engine, 1)})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--text", required=True, help="text whose windows make the pooled text sample")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--device", default="cuda", help="cpu runs the same figures (no steps ahead there)")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=256)
    args = ap.parse_args()
    for name in ("A (first in the process)", "B (built after A was freed)"):
        llm = build(args.model, args)
        for record in figures(llm, name, args):
            keep = ("engine", "sample", "decode_tok_s", "step_ms", "steps", "host_ms", "device_wait_ms", "host_steps")
            print(json.dumps({k: record[k] for k in keep if k in record}), flush=True)
        del llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
