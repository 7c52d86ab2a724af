"""What the mixture-of-experts kernel tests share: expert weights (a shared expert with
a Linear's transposed strides), unambiguous router logits, tolerances and a CUDA-graph
replay of a step (the CUDA markers and the error measure are the attention tests')."""

from __future__ import annotations

from typing import Callable

import torch

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def distinct_logits(t: int, e: int, gen: torch.Generator) -> torch.Tensor:
    """Rows of well-separated values in random order: top-k order is unambiguous."""
    return torch.stack([torch.randperm(e, generator=gen).float() * 0.37 for _ in range(t)]) - 1.0


def moe_weights(e: int, h: int, i: int, gen: torch.Generator, dtype=torch.float32, shared: bool = False):
    """Stacked expert weights, plus a shared expert stored column-major (a Linear's weight
    seen through a transpose) to cover arbitrary strides."""
    w13 = (torch.randn(e, 2 * i, h, generator=gen) * h**-0.5).to(dtype)
    w2 = (torch.randn(e, h, i, generator=gen) * i**-0.5).to(dtype)
    if not shared:
        return w13, w2, None, None
    s13 = (torch.randn(h, 2 * i, generator=gen) * h**-0.5).to(dtype).T
    s2 = (torch.randn(i, h, generator=gen) * i**-0.5).to(dtype).T
    assert s13.stride() == (1, 2 * i) and s2.stride() == (1, h)
    return w13, w2, s13, s2


def replayed(step: Callable[[], torch.Tensor]) -> torch.Tensor:
    """``step()``'s output from a CUDA graph of it, captured after a warm-up call on a side
    stream (Triton compiles there, outside the capture) and replayed once."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    graph.replay()
    torch.cuda.synchronize()
    return out
