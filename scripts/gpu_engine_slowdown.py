"""What, in building a second engine, slows every engine's decode graph (GPU).

Session 38 (H100, `random:train-gpu-deep`, c=1): the first engine of a process replayed
its batch-1 decode graph in 0.870-0.873 ms; once a second engine was built, that engine's
graph took 0.983 ms and the first engine's own graph 0.987 ms too, whether or not the
first was still alive. The GPU's clocks had not moved, and 15 s of matmuls on the first
engine alone left it at 0.874 ms. So something a build does to the process (or the
device) makes the graphs of all engines slower. The bench builds one engine per draft
count, so its plain and speculative figures all come from such later engines, while a
server builds one.

This script takes the build apart, one JSON line per probe (a single prompt's decode
step, the batch-1 graph replayed back to back, and the same replays queued behind a sleep
kernel, which parts the host's launch time from the device's run time), in one process:

1. engine A alone;
2. after 2 GiB more of device memory is allocated and written;
3. after engine B is built without CUDA graphs (weights, KV pools, warm-up compiles);
4. after engine C is built with its graphs (A and C probed);
5. after B and C are freed;

then, in a fresh process, a speculative engine (``--spec mtp``, k=3) first: its batch-1
decode graph replayed (no decode: its steps are rounds), to tell whether a server that
speculates (three sets of graphs captured) pays the same.

    python scripts/gpu_engine_slowdown.py random:train-gpu-deep
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import time

import torch

from gpu_plain_gap import build  # scripts/ is on the path when a script runs

from ninfer import LLM
from ninfer.bench import ninfer_runs
from ninfer.bench.figures import graph_replay_ms
from ninfer.bench.workload import fixed_workload


def probe(llm: LLM, engine: str, after: str, decode: bool = True) -> None:
    """One prompt decoded alone (``decode``), then the batch-1 graph replayed."""
    e = llm.engine
    record = {"engine": engine, "after": after}
    if decode:
        work = fixed_workload(1, 128, 256, llm.get_tokenizer().vocab_size, 1)
        record["step_ms"] = round(ninfer_runs.decode_throughput(e, work)["step_ms"], 4)
    print(json.dumps({**record, "replay_ms": graph_replay_ms(e, 1), **queued_replay(e), **clocks()}), flush=True)


def queued_replay(engine, repeats: int = 50) -> dict:
    """The batch-1 graph's replays split into the host's time to launch one and the device's
    time to run one: a sleep kernel holds the stream while the host queues every replay, so
    the device then runs them with no launch gap between them. Back-to-back replays
    (``replay_ms``) take the larger of the two; if ``host_launch_ms`` is the larger, what
    slows the graphs is the host's launch, not the GPU."""
    graphs = engine.runner.graphs
    bucket = graphs.bucket_for(1) if graphs is not None else None
    if bucket is None:
        return {}
    graphs.replay(bucket)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1_000_000_000)  # about half a second at 2 GHz: longer than queueing them all
    start.record()
    t0 = time.perf_counter()
    for _ in range(repeats):
        graphs.replay(bucket)
    host_ms = (time.perf_counter() - t0) * 1000 / repeats
    end.record()
    end.synchronize()
    return {"queued_replay_ms": round(start.elapsed_time(end) / repeats, 4), "host_launch_ms": round(host_ms, 4)}


def clocks() -> dict:
    """The GPU's SM and memory clocks now (MHz; NVML), empty where there are none."""
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
        return {"sm_mhz": pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM),
                "mem_mhz": pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_MEM)}
    except Exception:  # no NVML, or no GPU
        return {}


def first_process(args) -> None:
    a = build(args.model, args)
    probe(a, "A", "alone")
    ballast = torch.ones(2 << 30, dtype=torch.uint8, device=args.device)
    probe(a, "A", "2 GiB more device memory")
    b = build(args.model, args, cuda_graph=False)
    probe(a, "A", "B built without graphs")
    c = build(args.model, args)
    probe(a, "A", "C built with graphs")
    probe(c, "C", "C built with graphs")
    del b, c, ballast
    gc.collect()
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
    probe(a, "A", "B and C freed")


def spec_process(args) -> None:
    s = build(args.model, args, spec="mtp", draft_tokens=3)
    probe(s, "S (mtp k=3, first in its process)", "alone", decode=False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--part", choices=("first", "spec", "both"), default="both")
    args = ap.parse_args()
    args.prompt_len, args.output_len = 128, 256  # gpu_plain_gap.build sizes the engine by them
    if args.part in ("first", "both"):
        first_process(args)
    if args.part == "spec":
        spec_process(args)
    elif args.part == "both":  # a fresh process: the speculative engine is its first
        subprocess.run([sys.executable, __file__, args.model, "--dtype", args.dtype, "--device", args.device,
                        "--part", "spec"], check=False)


if __name__ == "__main__":
    main()
