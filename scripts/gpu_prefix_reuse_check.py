#!/usr/bin/env python3
"""Exact prefix reuse on one CUDA GPU: state snapshots (hybrid) and the host KV tier.

What the CPU tests cannot show: the pinned host tiers and their asynchronous copies,
ordered on the compute stream. For each tiny family, a two-turn conversation (turn 2's
prompt = turn 1's prompt and reply plus more, with an unrelated request in between) runs
under four cache setups; every setup must give turn 2 the same greedy tokens as a run
without prefix reuse, and the counters must show the tier at work:

- ``device``: default capacities (snapshots stay on the device);
- ``host-snapshots``: one device snapshot row, so turn 1's snapshots go through the host;
- ``host-kv``: a KV pool of 16 pages, so turn 1's pages go through the host;
- ``both``: the two together.

Prints one line per run and exits non-zero on any mismatch.

    python3 scripts/gpu_prefix_reuse_check.py [--dtype fp32|bf16]
"""

from __future__ import annotations

import argparse
import sys

import torch

from ninfer import LLM, SamplingParams
from ninfer.engine.stats import ContextCacheCounters

FAMILIES = ("qwen3", "qwen3_moe", "qwen3_next", "qwen3_5", "qwen3_5_moe")
SETUPS = {
    "device": {},
    "host-snapshots": {"device_state_slots": 1, "host_state_slots": 4},
    "host-kv": {"max_context": 64, "kv_capacity": 64, "max_concurrency": 1},
    "both": {"max_context": 64, "kv_capacity": 64, "max_concurrency": 1, "device_state_slots": 1,
             "host_state_slots": 4},
}
GREEDY = SamplingParams(max_tokens=9, temperature=0, presence_penalty=0.0, ignore_eos=True)


def two_turns(llm: LLM) -> tuple[list[int], list[int], int]:
    tok = llm.get_tokenizer()
    p1 = tok.encode("Once upon a time, in a land far away, there lived a")
    first = llm.generate({"prompt_token_ids": p1}, GREEDY)[0]
    llm.generate({"prompt_token_ids": tok.encode("Something unrelated that takes the pool's pages.")}, GREEDY)
    p2 = p1 + first.outputs[0].token_ids + tok.encode(" and then the story went on")
    second = llm.generate({"prompt_token_ids": p2}, GREEDY)[0]
    return first.outputs[0].token_ids, second.outputs[0].token_ids, second.num_cached_tokens


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs CUDA", file=sys.stderr)
        return 2
    base = {"dtype": args.dtype, "device": "cuda", "max_concurrency": 2, "prefill_chunk": 16, "block_size": 4}
    failed = 0
    for family in FAMILIES:
        want = two_turns(LLM(f"tiny:{family}", **base, no_prefix_reuse=True))
        for name, setup in SETUPS.items():
            llm = LLM(f"tiny:{family}", **{**base, **setup})
            got = two_turns(llm)
            torch.cuda.synchronize()
            c = ContextCacheCounters.of(llm.engine.scheduler)
            # the captured path, not an eager fallback that would pass as well
            ok = got[:2] == want[:2] and got[2] > 0 and llm.engine.runner.graphs is not None
            failed += not ok
            print(f"{'ok  ' if ok else 'FAIL'} {family:12} {name:15} cached {got[2]:3}  {c.summary()}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
