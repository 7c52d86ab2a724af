#!/usr/bin/env python3
"""Does the engine's decode speed reach a client? ``ninfer-serve`` on one GPU, timed from outside.

Starts ``ninfer-serve MODEL`` (default ``random:qwen3.6-27b``: the released shape with
random weights built in device memory), times its startup until ``/health`` answers 200,
then sends streamed chat requests one at a time and prints one JSON line each:

- ``client_tok_s``: what the client sees, ``(n - 1)`` tokens over the request's wall time
  less the server's prompt time (random weights mostly pick tokens past the tiny
  tokenizer's 512, which decode to no text and so send no chunk: chunk arrival times
  would not mark the tokens); ``client_end_to_end_tok_s`` keeps the prompt time in;
- ``server_tok_s``: the server's own ``timings.predicted_per_second`` (first to last token
  inside the engine), which is what ``ninfer-bench --only decode --concurrency 1`` measures.

Needs CUDA and ``httpx``. The server's log goes to ``--log``.

    python3 scripts/gpu_serve_speed.py random:qwen3.6-27b --requests 3 --max-tokens 256
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import httpx


def wait_ready(port: int, proc: subprocess.Popen, limit_s: float) -> float:
    started = time.perf_counter()
    while time.perf_counter() - started < limit_s:
        if proc.poll() is not None:
            raise SystemExit(f"ninfer-serve exited with {proc.returncode} before it was ready")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return time.perf_counter() - started
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise SystemExit(f"not ready after {limit_s} s")


def streamed_request(port: int, model: str, max_tokens: int, seed: int) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": "Tell me a long story about a lighthouse."}],
            "max_tokens": max_tokens, "stream": True, "stream_options": {"include_usage": True},
            "temperature": 0, "seed": seed}
    chunks, usage, timings = 0, None, None
    start = time.perf_counter()
    with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: "):])
            chunks += 1
            usage = event.get("usage") or usage
            timings = event.get("timings") or timings
    end = time.perf_counter()
    n = usage["completion_tokens"]
    prompt_s = timings["prompt_ms"] / 1000
    return {"completion_tokens": n, "chunks": chunks, "wall_s": round(end - start, 4),
            "server_prompt_ms": round(timings["prompt_ms"], 2),
            "client_tok_s": round((n - 1) / max(end - start - prompt_s, 1e-9), 2),
            "client_end_to_end_tok_s": round(n / (end - start), 2),
            "server_tok_s": round(timings["predicted_per_second"], 2)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 epilog="ninfer-serve flags to add go after --, e.g. -- --spec mtp --draft-tokens 3")
    ap.add_argument("model", nargs="?", default="random:qwen3.6-27b")
    ap.add_argument("--port", type=int, default=18090)
    ap.add_argument("--requests", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--ready-limit-s", type=float, default=300)
    ap.add_argument("--log", default="serve_speed.log")
    # split by hand: argparse gives an optional positional and a "*" one the same first chunk
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    args = ap.parse_args(argv[:cut])
    args.serve_args = argv[cut + 1:]
    cmd = ["ninfer-serve", args.model, "--device", "0", "--port", str(args.port), "--max-concurrency", "8",
           "--max-context", "8192", *args.serve_args]
    with open(args.log, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        try:
            ready_s = wait_ready(args.port, proc, args.ready_limit_s)
            print(json.dumps({"model": args.model, "startup_s": round(ready_s, 1)}), flush=True)
            model = httpx.get(f"http://127.0.0.1:{args.port}/v1/models").json()["data"][0]["id"]
            streamed_request(args.port, model, 8, seed=0)  # untimed: the measured requests then start alike
            for i in range(args.requests):
                print(json.dumps({"model": args.model, "request": i, **streamed_request(args.port, model, args.max_tokens, i)}),
                      flush=True)
        finally:
            proc.terminate()
            proc.wait(60)
    return 0


if __name__ == "__main__":
    sys.exit(main())
