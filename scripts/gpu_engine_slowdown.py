"""What slows every CUDA graph's replay once more graphs are captured in the process (GPU).

Session 38 (H100, `random:train-gpu-deep`, c=1): the first engine of a process replayed
its batch-1 decode graph in 0.870-0.873 ms; once a second engine was built, that engine's
graph took 0.983 ms and the first engine's own graph 0.987 ms too. Session 39 (H100, this
script): it is the device's time, not the host's (a graph launches in 3 us); an engine
built without graphs leaves the first engine's replays as they were, and so does one
engine capturing eleven batch buckets, but two small torch graphs captured after the
engine's own slow its replays to 0.983 ms for good (freeing them changes nothing); with
PDL off (`NINFER_PDL=0`) the replays take 0.934 ms before and after. A speculating engine,
first in its process, replays its plain decode graph in 0.996 ms. Session 41 (``trigger``,
``rounds``): the second extra graph on a pool of its own brings the slow state whatever it
holds (Triton adds with or without PDL, torch's adds); the same adds run eagerly never do,
and capturing the engine's graphs again on a fresh stream and pool does not undo it. On
the engine's own stream and pool (``NINFER_GRAPH_SHARE=1``) the third extra graph brings
it, whatever it holds, and capturing the engine's graphs again there does undo it. A
speculating engine's round graph (captured last) replays no slower after three small
graphs than before them, shared or not.

Parts (``--part``), one JSON line per probe (a single prompt's decode step, the batch-1
graph replayed back to back, and the same replays queued behind a sleep kernel, which
parts the host's launch time from the device's run time):

- ``first``: engine A alone, after 2 GiB more device memory, after engine B is built
  without graphs, after engine C is built with them (A and C probed), after B and C are
  freed;
- ``graphs``: engine A alone, after the caches are emptied as each capture empties them,
  after each small graph captured, each on torch's default stream and on a side stream,
  then on a stream created after the captures, then with the small graphs freed;
- ``fresh``: four small graphs captured and replayed, then engine A built and probed;
- ``prelaunch``: engine A built without its warm-up, four small graphs captured before any
  graph has been launched, then A probed;
- ``shared`` (with ``NINFER_GRAPH_SHARE=1``): graphs of a norm engine A's graphs hold, of
  a norm compiled afresh and of torch's adds, captured one by one on A's stream and pool;
- ``trigger`` (``--graphs pdl|plain|torch|eager``): four graphs of twenty adds captured
  one by one after engine A's (on A's stream and pool with ``NINFER_GRAPH_SHARE=1``),
  probed after each: Triton adds launched with PDL, the same launched without it, torch's
  own adds; or (``eager``) torch's adds run without a graph; then A's graphs captured
  again and probed. One kind a process, so each starts from the fast state;
- ``buckets``: every decode bucket of engine A alone (``buckets:NINFER_PDL=0``: the peer);
- ``rounds``: a speculating engine's batch-1 round graph and decode graph replayed, then
  again after three small graphs;
- ``spec``: a speculating engine (``--spec mtp``, k=3) first in its process, its plain
  decode graph replayed on the default stream and on a side stream;
- ``both`` (the default): ``first``, then ``spec`` in a fresh process.

    python scripts/gpu_engine_slowdown.py random:train-gpu-deep --part graphs
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import subprocess
import sys
import time

import torch
import triton
import triton.language as tl

from gpu_plain_gap import build  # scripts/ is on the path when a script runs

from ninfer import LLM
from ninfer.bench import bandwidth as bw
from ninfer.bench import ninfer_runs
from ninfer.bench.figures import graph_replay_ms
from ninfer.bench.workload import fixed_workload
from ninfer_kernels.triton import pdl


def probe(llm: LLM, engine: str, after: str, decode: bool = True, stream=None) -> None:
    """One prompt decoded alone (``decode``), then the batch-1 graph replayed; with a
    ``stream``, only the replays, on it (the engine's own steps stay on the stream it
    knows)."""
    e = llm.engine
    decode = decode and stream is None
    record = {"engine": engine, "after": after, "stream": "side" if stream is not None else "default",
              "pdl": os.environ.get("NINFER_PDL", "1") != "0", "pdl_trigger": os.environ.get("NINFER_PDL_TRIGGER", "1")}
    with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
        if decode:
            work = fixed_workload(1, 128, 256, llm.get_tokenizer().vocab_size, 1)
            record["step_ms"] = round(ninfer_runs.decode_throughput(e, work)["step_ms"], 4)
        record.update(replay_ms=graph_replay_ms(e, 1), **queued_replay(e))
    print(json.dumps({**record, **clocks()}), flush=True)


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


def captured(fn, pool=None, stream=None) -> torch.cuda.CUDAGraph:
    """A graph of ``fn()`` (torch's default capture stream and a pool of its own unless given)."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, stream=stream):
        fn()
    return graph


def small_graphs(x: torch.Tensor, count: int, pool=None, replay: bool = False) -> list:
    """``count`` graphs of twenty in-place adds on ``x`` (torch's own kernels, no PDL),
    captured one after the other (each replayed once when ``replay``)."""
    graphs = []
    for _ in range(count):
        graphs.append(captured(lambda: [x.add_(1) for _ in range(20)], pool))
        if replay:
            graphs[-1].replay()
    return graphs


@triton.jit
def _add_one(x_ptr, n, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    if USE_PDL:
        pdl.wait()
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=ok) + 1, mask=ok)


def triton_adds(x: torch.Tensor, use_pdl: bool, count: int = 20) -> None:
    for _ in range(count):
        _add_one[(triton.cdiv(x.numel(), 1024),)](x, x.numel(), BLOCK=1024, USE_PDL=use_pdl,
                                                  **pdl.launch_options(use_pdl))


def trigger_process(args) -> None:
    """Session 40: with the engine's stream and pool shared, a third graph (torch's adds) slowed
    A where two graphs of PDL norms had not; two torch graphs on pools of their own always do.
    Here one kind of extra graph a process, four of them, so the count is the same for each
    (with ``NINFER_GRAPH_SHARE=1`` on A's own stream and pool)."""
    from ninfer.engine import cuda_graph

    a = build(args.model, args)
    probe(a, "A", "alone")
    # with NINFER_GRAPH_SHARE=1 the extra graphs go onto A's own capture stream and pool
    stream, pool = cuda_graph._SHARED.get(cuda_graph._device_key(torch.device(args.device)), (None, None))
    x = torch.zeros(4096, device=args.device)
    fn = {"pdl": lambda: triton_adds(x, True), "plain": lambda: triton_adds(x, False),
          "torch": lambda: [x.add_(1) for _ in range(20)], "eager": lambda: [x.add_(1) for _ in range(20)]}
    what = {"pdl": "graphs of Triton adds launched with PDL", "plain": "graphs of Triton adds launched without PDL",
            "torch": "graphs of torch's adds", "eager": "rounds of torch's adds run eagerly"}[args.graphs]
    kept = []
    where = " on A's stream and pool" if stream is not None else ""
    for n in range(1, 5):
        fn[args.graphs]()  # compiled and loaded before any capture
        torch.cuda.synchronize()
        if args.graphs != "eager":
            kept.append(captured(fn[args.graphs], pool, stream))
        probe(a, "A", f"{n} {what}{where}")
    a.engine.runner.graphs.capture()  # A's graphs again, batch 1 last: the newest graph once more
    probe(a, "A", f"A's decode graphs captured again after the {what}")


def rounds_process(args) -> None:
    """A speculating engine's batch-1 round graph (the last captured) and plain decode graph
    (the first), then the same after three small graphs: whether the graph a speculating
    engine replays most was ever in the slow state (only its decode graph was probed before)."""
    s = build(args.model, args, spec="mtp", draft_tokens=3)
    rounds = s.engine.runner.rounds
    graphs = getattr(rounds, "_graphs", None) or {}
    if rounds is None or 1 not in graphs:
        raise SystemExit("the engine has no batch-1 round graph (NINFER_DEVICE_ROUNDS=0?)")

    def report(after: str) -> None:
        print(json.dumps({"engine": "S (mtp k=3)", "after": after,
                          "round_replay_ms": round(bw.cuda_ms(graphs[1].replay, 50), 4),
                          "decode_replay_ms": round(graph_replay_ms(s.engine, 1), 4), **clocks()}), flush=True)

    report("alone")
    kept = small_graphs(torch.zeros(1024, device=args.device), 3)
    report(f"{len(kept)} small graphs captured")


def buckets_process(args) -> None:
    """Every decode bucket's graph of engine A alone, replayed back to back. Its buckets are
    captured largest first, so the batch-1 graph probed everywhere else is the newest; with
    the engine's stream and pool shared, three graphs captured after it slowed it and capturing
    it again sped it up (session 41). Run once more with ``NINFER_PDL=0`` as the peer: a
    bucket slower with PDL than without is in the slow state."""
    a = build(args.model, args)
    graphs = a.engine.runner.graphs
    for bucket in graphs.buckets:
        ms = bw.cuda_ms(lambda: graphs.replay(bucket), 50)
        print(json.dumps({"engine": "A", "bucket": bucket, "replay_ms": round(ms, 4),
                          "pdl": os.environ.get("NINFER_PDL", "1") != "0", **clocks()}), flush=True)


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


def graphs_process(args) -> None:
    """Which capture starts the slowdown (session 39: the second small graph captured after
    the engine's own), whether the graphs then replay at full speed on a stream of their own
    rather than torch's default (legacy) stream, and whether freeing the extra graphs undoes it."""
    a = build(args.model, args)
    side = torch.cuda.Stream()
    probe(a, "A", "alone")
    probe(a, "A", "alone", stream=side)
    for _ in range(2):  # what torch.cuda.graph does before each capture, without the capture
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        getattr(torch._C, "_host_emptyCache", lambda: None)()
        probe(a, "A", "caches emptied as a capture empties them")
    x = torch.zeros(1024, device=args.device)
    pool = torch.cuda.graph_pool_handle() if args.shared_pool else None
    kept = []
    for n in (1, 1, 2):
        kept += small_graphs(x, n, pool)
        probe(a, "A", f"{len(kept)} small graphs captured")
        probe(a, "A", f"{len(kept)} small graphs captured", stream=side)
    probe(a, "A", "a stream created after them", stream=torch.cuda.Stream())
    del kept
    gc.collect()
    torch.cuda.synchronize()
    probe(a, "A", "the extra graphs freed")


def fresh_process(args) -> None:
    """Small graphs captured and replayed before the engine is built: whether the captures
    that slow an engine must come after its own."""
    kept = small_graphs(torch.zeros(1024, device=args.device), 4, replay=True)
    torch.cuda.synchronize()
    a = build(args.model, args)
    probe(a, "A", f"{len(kept)} small graphs captured and replayed before A was built")


def prelaunch_process(args) -> None:
    """Small graphs captured after the engine's own but before any graph was launched (its
    warm-up skipped): whether captures slow the graphs only once graphs have run."""
    from ninfer.engine import builder

    real, builder.warm_up = builder.warm_up, lambda *a, **k: 0.0
    try:
        a = build(args.model, args)
    finally:
        builder.warm_up = real
    kept = small_graphs(torch.zeros(1024, device=args.device), 4)
    probe(a, "A", f"{len(kept)} small graphs captured before any graph was launched (no warm-up)")


def shared_process(args) -> None:
    """Run with ``NINFER_GRAPH_SHARE=1``. Session 40: a second engine capturing on the first
    one's stream into its pool leaves both fast, but a speculating engine, every set shared,
    is slow. Here graphs go onto engine A's own capture stream and pool, least likely trigger
    first: a norm A's graphs already hold (the same compiled kernel), the same norm at another
    width (a function compiled afresh, launched with PDL), then torch's own adds. Which one
    first slows A's replays says whether graphs of functions A's graphs lack are the trigger."""
    from ninfer.engine import cuda_graph
    from ninfer_kernels import ops

    if not cuda_graph._share():
        raise SystemExit("--part shared needs NINFER_GRAPH_SHARE=1")
    a = build(args.model, args)
    device = torch.device(args.device)
    stream, pool = cuda_graph._SHARED[cuda_graph._device_key(device)]
    probe(a, "A", "alone (every set on one stream and pool)")
    norms = [(n, p) for n, p in a.engine.model.named_parameters() if n.endswith("norm.weight") and p.dim() == 1]
    weight = max(norms, key=lambda item: item[1].numel())[1]  # the hidden size's
    narrow = torch.ones(384, dtype=weight.dtype, device=device)
    x, y = torch.randn(1, weight.numel(), dtype=weight.dtype, device=device), torch.zeros(1024, device=device)
    x_narrow = torch.randn(1, 384, dtype=weight.dtype, device=device)
    kept = []
    for what, fn in (("a norm A's graphs hold", lambda: ops.rms_norm(x, weight, 1e-6)),
                     ("a norm compiled afresh (another width, PDL)", lambda: ops.rms_norm(x_narrow, narrow, 1e-6)),
                     ("torch's adds", lambda: [y.add_(1) for _ in range(20)])):
        started = time.perf_counter()
        fn()  # compiled and loaded before the capture, as capture_buckets does
        torch.cuda.synchronize()
        first_s = time.perf_counter() - started  # about a second when it compiled
        kept.append(captured(fn, pool, stream))
        probe(a, "A", f"a graph of {what} on A's stream and pool (first call {first_s:.2f} s)")


def spec_process(args) -> None:
    s = build(args.model, args, spec="mtp", draft_tokens=3)
    probe(s, "S (mtp k=3, first in its process)", "alone", decode=False)
    probe(s, "S (mtp k=3, first in its process)", "alone", decode=False, stream=torch.cuda.Stream())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--shared-pool", action="store_true", help="--part graphs: the extra graphs share one memory pool")
    ap.add_argument("--part", choices=(*PARTS, "both"), default="both")
    ap.add_argument("--graphs", choices=("pdl", "plain", "torch", "eager"), default="pdl",
                    help="--part trigger: which extra graphs")
    args = ap.parse_args()
    args.prompt_len, args.output_len = 128, 256  # gpu_plain_gap.build sizes the engine by them
    if args.part != "both":
        PARTS[args.part](args)
        return
    first_process(args)
    # a fresh process: the speculative engine is its first
    subprocess.run([sys.executable, __file__, args.model, "--dtype", args.dtype, "--device", args.device,
                    "--part", "spec"], check=False)


#: --part -> the process it runs ("both": first, then spec in a fresh process)
PARTS = {"first": first_process, "spec": spec_process, "graphs": graphs_process, "fresh": fresh_process,
         "shared": shared_process, "trigger": trigger_process, "rounds": rounds_process,
         "buckets": buckets_process, "prelaunch": prelaunch_process}


if __name__ == "__main__":
    main()
