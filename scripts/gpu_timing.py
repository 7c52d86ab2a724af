"""Helpers shared by the GPU check scripts: error against a reference, timed replays, the report."""

from __future__ import annotations

import functools
import json
from typing import Callable, Optional

import torch
from triton.testing import do_bench


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """Relative L2 error in float64; NaN when ``got`` holds a non-finite value."""
    if not torch.isfinite(got).all():
        return float("nan")
    want = want.double()
    return float((got.double() - want).norm() / want.norm().clamp_min(1e-30))


@functools.cache
def copy_bytes_per_s() -> float:
    """This card's device-to-device copy rate (bytes read and written per second), measured
    once: the yardstick of the sweeps' bandwidth shares (an H100 copies at about 70% of
    an H200's rate, so one card's constant misstates the other's shares)."""
    from ninfer.bench.bandwidth import copy_bandwidth
    return copy_bandwidth(torch.device("cuda"))


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


class Report:
    """One JSON object per line to ``path`` (flushed as it goes) and a printed line per row.

    ``judge(row)`` says whether a check row passed (None: not a check); its verdict goes
    into ``row["ok"]``. A row with ``ok`` False or an ``error`` counts in ``failed``."""

    def __init__(self, path: str, judge: Optional[Callable[[dict], Optional[bool]]] = None):
        self.file = open(path, "w")
        self.judge = judge
        self.rows: list[dict] = []
        self.failed = 0

    def add(self, row: dict) -> None:
        verdict = self.judge(row) if self.judge is not None else None
        if verdict is not None:
            row["ok"] = bool(verdict)
        self.failed += row.get("ok") is False or "error" in row
        self.rows.append(row)
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()
        print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)
