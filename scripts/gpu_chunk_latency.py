#!/usr/bin/env python3
"""What the prefill chunk costs a user, per chunk size: a long prompt's time to first token
alone, and the same prompt arriving while other requests decode.

For each of ``--chunks`` (one loaded engine; ``Scheduler.set_prefill_chunk`` between
runs, nothing else depends on it):

1. ``alone``: a fresh ``--prompt``-token prompt (no prefix reuse), time to its first
   token, and how far the device allocator's peak rose above its resting use (the
   activations a chunk this size needs beside the KV pool); with ``--profile``, the
   device time its kernels took and the largest kernels;
2. ``mixed``: ``--decoders`` requests decode (``--decode-prompt`` tokens each), then the
   long prompt arrives. Reported: the decoders' inter-token gap before it arrives (median),
   while it prefills (mean and worst), and the long prompt's time to first token.

The trade it measures: a larger chunk prefills a long prompt faster (fewer steps, each
with fixed costs: weights read once a step, the host's launches), a smaller one stalls
the other requests' tokens for less time per step. Each line also counts the Triton
compiles after the engine's warm-up (:mod:`ninfer.engine.compile_watch`): each one is a
stall the warm-up should have taken. One JSON line per chunk and part.

    python3 scripts/gpu_chunk_latency.py random:qwen3.6-35b-a3b --chunks 1024,2048,4096,8192
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import Counter

import torch
from torch.profiler import ProfilerActivity, profile

from ninfer import LLM
from ninfer.bench.ninfer_runs import GREEDY
from ninfer.engine.compile_watch import process_watch
from ninfer.engine.request import EngineRequest
from ninfer.model.random_weights import model_source
from ninfer.sampling_params import SamplingParams


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Runner:
    def __init__(self, llm: LLM, device: torch.device, prompt: int, decode_prompt: int) -> None:
        self.engine = llm.engine
        self.device = device
        self.prompt = prompt
        self.decode_prompt = decode_prompt
        self.vocab = llm.loaded.tokenizer.vocab_size
        self.serial = 0

    def ids(self, n: int) -> list[int]:
        self.serial += 1  # every prompt differs from the first token: nothing is reused
        return [(7 * i + 13 * self.serial) % self.vocab for i in range(n)]

    def submit(self, n_prompt: int, max_tokens: int) -> str:
        rid = f"r{self.serial}"
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, **GREEDY)
        self.engine.add_request(EngineRequest(rid, self.ids(n_prompt), params, lookup_prefix_cache=False,
                                              commit_prefix_cache=False))
        return rid

    def drain(self) -> None:
        while self.engine.has_unfinished():
            self.engine.step()

    def alone(self) -> float:
        """Seconds from a long prompt's arrival to its first token, nothing else running."""
        self.submit(self.prompt, 1)
        sync(self.device)
        start = time.perf_counter()
        self.drain()
        sync(self.device)
        return time.perf_counter() - start

    def activation_peak(self) -> int:
        """Bytes the device allocator's peak rose above its resting use during an alone
        prefill: the headroom a chunk this size needs beside the KV pool."""
        if self.device.type != "cuda":
            return 0
        torch.cuda.reset_peak_memory_stats(self.device)
        resting = torch.cuda.memory_allocated(self.device)
        self.alone()
        return torch.cuda.max_memory_allocated(self.device) - resting

    def mixed(self, decoders: int, steps_before: int = 12) -> dict:
        """The decoders' token gaps before and while a long prompt prefills beside them."""
        ids = {self.submit(self.decode_prompt, 4000) for _ in range(decoders)}
        started: set[str] = set()
        while len(started) < decoders:  # their own prefills first
            started.update(e.request_id for e in self.engine.step() if e.token_ids)
        before = self._gaps(steps_before, ids)
        long_id = self.submit(self.prompt, 1)
        sync(self.device)
        arrived = time.perf_counter()
        during, last, ttft = [], arrived, None
        while ttft is None:
            events = self.engine.step()
            now = time.perf_counter()
            if any(e.request_id in ids and e.token_ids for e in events):
                during.append(now - last)
                last = now
            if any(e.request_id == long_id and e.finished for e in events):
                ttft = now - arrived
        for rid in ids:
            self.engine.abort_request(rid)
        self.drain()
        return {"itl_before_ms": ms(statistics.median(before)), "itl_during_mean_ms": ms(statistics.mean(during)),
                "itl_during_max_ms": ms(max(during)), "steps_during": len(during), "ttft_s": round(ttft, 4)}

    def _gaps(self, steps: int, ids: set[str]) -> list[float]:
        gaps, last = [], time.perf_counter()
        while len(gaps) < steps:
            if any(e.request_id in ids and e.token_ids for e in self.engine.step()):
                now = time.perf_counter()
                gaps.append(now - last)
                last = now
        return gaps


def ms(seconds: float) -> float:
    return round(1000 * seconds, 2)


def device_time(runner: Runner, top: int) -> dict:
    """One ``alone`` prefill under torch's profiler: the device's busy time and its largest kernels."""
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as trace:
        wall = runner.alone()
    kernels: Counter = Counter()
    counts: Counter = Counter()
    for evt in trace.events():
        if evt.device_type == torch.autograd.DeviceType.CUDA:
            name = evt.name[:90]
            kernels[name] += evt.time_range.elapsed_us()
            counts[name] += 1
    busy = sum(kernels.values())
    return {"wall_ms": ms(wall), "device_busy_ms": round(busy / 1000, 2), "launches": sum(counts.values()),
            "kernels": [[name, round(us / 1000, 2), counts[name]] for name, us in kernels.most_common(top)]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--chunks", default="1024,2048,4096,8192")
    ap.add_argument("--prompt", type=int, default=8192)
    ap.add_argument("--decoders", type=int, default=8)
    ap.add_argument("--decode-prompt", type=int, default=512)
    ap.add_argument("--profile", default="", help="chunk sizes whose alone prefill is profiled too")
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    device = torch.device(args.device)
    chunks = [int(c) for c in args.chunks.split(",")]
    profiled = {int(c) for c in args.profile.split(",") if c.strip()}
    path, weights = model_source(args.model, torch.bfloat16, device)
    kv = 2 * args.prompt + args.decoders * (args.decode_prompt + 4096)
    llm = LLM(path, device=args.device, dtype="bf16", max_num_seqs=args.decoders + 1, weights=weights,
              max_context=args.prompt + 4096, kv_capacity=kv, prefill_chunk=max(chunks))
    runner = Runner(llm, device, args.prompt, args.decode_prompt)
    watch = process_watch()
    compiles = (lambda: watch.compiles) if watch is not None else (lambda: -1)
    for chunk in chunks:
        llm.engine.scheduler.set_prefill_chunk(chunk)
        before = compiles()
        peak = runner.activation_peak()  # also the untimed first run at this chunk
        line = {"model": args.model, "chunk": chunk, "prompt": args.prompt,
                "alone_ttft_s": round(min(runner.alone() for _ in range(2)), 4)}
        line["alone_tok_s"] = round(args.prompt / line["alone_ttft_s"], 1)
        line["activation_peak_mib"] = round(peak / 2**20, 1)
        line["mixed"] = {"decoders": args.decoders, **runner.mixed(args.decoders)}
        line["compiles_after_warm_up"] = compiles() - before  # the warm-up's misses: each a stall
        print(json.dumps(line), flush=True)
        if chunk in profiled:
            print(json.dumps({"model": args.model, "chunk": chunk, "profile": device_time(runner, args.top)}),
                  flush=True)


if __name__ == "__main__":
    sys.exit(main())
