"""What one link of a chain of dependent launches costs inside a CUDA graph (GPU only).

A batch-1 decode step of the 35B-A3B is about 370 kernels, each reading what the one
before wrote. Whatever a link costs beyond its own reads is what fusing two launches can
win, so this measures that floor: ``--links`` launches of one small Triton kernel, each
reading the previous one's output, captured in one graph and replayed back to back.
Microseconds per link, per payload and with PDL on and off (kernels/triton/pdl.py):

- ``scalar``: one program, one element;
- ``row``: one program reads ``--parts`` rows of ``--width`` bf16 values and writes one
  (the input norm's shape after a MoE layer: nine expert rows and the residual);
- ``grid``: ``--programs`` programs of one element each (a full-GPU grid's start and drain).

    python scripts/gpu_launch_floor.py --links 370 --width 2048 --parts 10 --programs 528
"""

from __future__ import annotations

import argparse
import json

import torch
import triton
import triton.language as tl

from ninfer_kernels.triton import pdl


@triton.jit
def _link_kernel(src_ptr, dst_ptr, PARTS: tl.constexpr, WIDTH: tl.constexpr, USE_PDL: tl.constexpr):
    offs = tl.program_id(0) * WIDTH + tl.arange(0, WIDTH)
    if USE_PDL:
        pdl.wait()  # src is the link before's output
    acc = tl.zeros([WIDTH], dtype=tl.float32)
    for p in tl.static_range(PARTS):
        acc += tl.load(src_ptr + p * WIDTH * tl.num_programs(0) + offs).to(tl.float32)
    tl.store(dst_ptr + offs, (acc * 0.5 + 1.0).to(dst_ptr.dtype.element_ty))


def chain_us(links: int, programs: int, parts: int, width: int, use_pdl: bool, repeats: int) -> float:
    """Microseconds per link of a replayed chain of ``links`` launches."""
    bufs = [torch.zeros(parts * programs * width, dtype=torch.bfloat16, device="cuda") for _ in range(2)]
    options = pdl.launch_options(use_pdl)

    def chain():
        for i in range(links):
            _link_kernel[(programs,)](bufs[i % 2], bufs[(i + 1) % 2], PARTS=parts, WIDTH=width, USE_PDL=use_pdl,
                                      num_warps=4, **options)

    chain()  # compile outside the capture
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        chain()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / (repeats * links)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--links", type=int, default=370)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--parts", type=int, default=10)
    parser.add_argument("--programs", type=int, default=528)
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()
    payloads = {"scalar": (1, 1, 1), "row": (1, args.parts, args.width), "grid": (args.programs, 1, 1)}
    for name, (programs, parts, width) in payloads.items():
        for use_pdl in (False, True):
            us = chain_us(args.links, programs, parts, max(width, 1), use_pdl, args.repeats)
            print(json.dumps({"payload": name, "programs": programs, "bytes_read": programs * parts * width * 2,
                              "pdl": use_pdl, "links": args.links, "us_per_link": round(us, 3),
                              "device": torch.cuda.get_device_name()}), flush=True)


if __name__ == "__main__":
    main()
