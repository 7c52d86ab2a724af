"""Helpers shared by the GPU check scripts: error against a reference, timed replays."""

from __future__ import annotations

from typing import Callable

import torch
from triton.testing import do_bench


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """Relative L2 error in float64; NaN when ``got`` holds a non-finite value."""
    if not torch.isfinite(got).all():
        return float("nan")
    want = want.double()
    return float((got.double() - want).norm() / want.norm().clamp_min(1e-30))


def bench(fn: Callable[[], object], rep: int = 100, warmup: int = 25) -> float:
    """Median milliseconds per call."""
    return do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def captured(fn: Callable[[], object]) -> tuple[Callable[[], None], object]:
    """``fn`` captured in a CUDA graph, warmed up (compiled) on a side stream first:
    (replay, the output tensors the replays write)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph.replay, out


def graphed(fn: Callable[[], object]) -> Callable[[], None]:
    """``fn`` captured in a CUDA graph (see :func:`captured`); returns its replay."""
    return captured(fn)[0]
