"""``ninfer-bench``: throughput figures as JSON lines, ours beside transformers'.

Example (CPU, the tiny model): ``ninfer-bench tiny:qwen3 --num-requests 32``.
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
    p.add_argument("model", nargs="?", default="tiny:qwen3", help="checkpoint dir or tiny:FAMILY (default tiny:qwen3)")
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
    llm = LLM(args.model, device=args.device, dtype=args.dtype, max_concurrency=max_c, max_context=longest,
              kv_capacity=longest * max_c, prefill_chunk=args.prefill_chunk)
    loaded = llm.loaded
    vocab = len(loaded.tokenizer) if hasattr(loaded.tokenizer, "__len__") else loaded.tokenizer.vocab_size
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
