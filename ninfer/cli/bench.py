"""``ninfer-bench``: throughput figures as JSON lines, ours beside transformers'.

Examples: ``ninfer-bench tiny:qwen3 --device cpu --num-requests 32`` (CPU, the tiny
model); ``ninfer-bench random:qwen3-8b`` (GPU, a full-size random checkpoint written once
into the cache).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys

from ninfer.bench import hf_runs, ninfer_runs
from ninfer.bench.workload import fixed_workload, random_workload


def _range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(",")
    return int(lo), int(hi or lo)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="ninfer-bench", description=__doc__)
    p.add_argument("model", nargs="?", default="tiny:qwen3", help="checkpoint dir, tiny:FAMILY, or random:SHAPE ("
                   "qwen3-0.6b, qwen3-8b); default tiny:qwen3")
    p.add_argument("--device", default="0", help="CUDA index, cuda or cpu (CPU when CUDA is absent)")
    p.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp16", "fp32"])
    p.add_argument("--num-requests", type=int, default=64, help="offline run: number of requests")
    p.add_argument("--input-len", type=_range, default=(100, 1024), help="offline prompt lengths LO,HI (uniform)")
    p.add_argument("--output-len", type=_range, default=(100, 1024), help="offline output lengths LO,HI (uniform)")
    p.add_argument("--concurrency", default="1,8", help="decode runs: comma-separated concurrency levels")
    p.add_argument("--decode-prompt-len", type=int, default=512)
    p.add_argument("--decode-output-len", type=int, default=256)
    p.add_argument("--max-concurrency", type=int, default=8, help="engine admission limit for the offline run")
    p.add_argument("--prefill-chunk", type=int, default=1024)
    p.add_argument("--hf-batch", type=int, default=16, help="transformers offline batch size")
    p.add_argument("--no-transformers", action="store_true", help="skip the transformers baseline")
    p.add_argument("--only", default="offline,decode", help="which figures: offline, decode")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def _resolve_random(model: str, device: str, dtype: str) -> str:
    """``random:SHAPE`` -> a cached full-size random checkpoint (built on first use)."""
    if not model.startswith("random:"):
        return model
    from ninfer.bench.random_checkpoint import make_random_checkpoint
    from ninfer.engine.builder import resolve_device, resolve_dtype
    from ninfer.tiny.cache import cache_root

    shape = model.split(":", 1)[1]
    dev = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, dev)
    out = cache_root().parent / "random" / f"{shape}-{str(torch_dtype).replace('torch.', '')}"
    return str(make_random_checkpoint(out, shape, torch_dtype, dev))


def emit(record: dict) -> None:
    print(json.dumps(record), flush=True)


def main(argv=None) -> int:
    args = parse_args(argv)
    from ninfer import LLM
    from ninfer.log import setup_logging

    setup_logging("warning")
    levels = [int(c) for c in args.concurrency.split(",") if c]
    only = set(args.only.split(","))
    max_c = max([args.max_concurrency] + levels)
    longest = max(args.input_len[1] + args.output_len[1], args.decode_prompt_len + args.decode_output_len)
    model = _resolve_random(args.model, args.device, args.dtype)
    device = int(args.device) if args.device.isdigit() else args.device
    llm = LLM(model, device=device, dtype=args.dtype, max_concurrency=max_c, max_context=longest,
              kv_capacity=longest * max_c, prefill_chunk=args.prefill_chunk)
    loaded = llm.loaded
    vocab = loaded.tokenizer.vocab_size  # prompt ids the tokenizer knows
    common = {"model": args.model, "device": str(loaded.device), "dtype": str(loaded.dtype).replace("torch.", ""),
              "host": platform.node()}
    hf = None if args.no_transformers else hf_runs.load_hf(loaded.model_dir, loaded.dtype, loaded.device)

    if "offline" in only:
        work = random_workload(args.num_requests, args.input_len, args.output_len, vocab, args.seed)
        ours = ninfer_runs.offline_throughput(llm.engine, work)
        emit({"figure": "offline_throughput", "engine": "ninfer", "requests": args.num_requests, **common, **ours})
        if hf is not None:
            theirs = hf_runs.offline_throughput(hf, work, args.hf_batch, loaded.device)
            emit({"figure": "offline_throughput", "engine": "transformers", "requests": args.num_requests,
                  "batch": args.hf_batch, **common, **theirs})
            emit({"figure": "offline_throughput_ratio", "ninfer_over_transformers":
                  ours["output_tok_s"] / theirs["output_tok_s"], **common})
    if "decode" in only:
        for c in levels:
            work = fixed_workload(c, args.decode_prompt_len, args.decode_output_len, vocab, args.seed + c)
            ours = ninfer_runs.decode_throughput(llm.engine, work)
            emit({"figure": "decode", "engine": "ninfer", "concurrency": c, **common, **ours})
            if hf is not None:
                theirs = hf_runs.decode_throughput(hf, work, loaded.device)
                emit({"figure": "decode", "engine": "transformers", "concurrency": c, **common, **theirs})
    return 0


if __name__ == "__main__":
    sys.exit(main())
