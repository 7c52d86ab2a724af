"""Memory-bandwidth figures: what the device can copy, and what a decode step must read.

Decode at low concurrency is bound by memory traffic: every step reads all weights
once plus each sequence's cached keys and values. Utilisation is that traffic times
the step rate over the bandwidth a plain device-to-device copy reaches.
"""

from __future__ import annotations

from typing import Callable

import torch


def cuda_ms(fn: Callable[[], object], repeats: int, warmup: int = 1) -> float:
    """Device milliseconds per call of ``fn`` run back to back (timed with CUDA events)."""
    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / repeats


def copy_bandwidth(device: torch.device, mib: int = 2048, iters: int = 20) -> float:
    """Bytes per second moved by ``dst.copy_(src)`` (each byte read once and written once)."""
    n = mib << 20
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = cuda_ms(lambda: dst.copy_(src), iters, warmup=3)
    del src, dst
    return 2 * n / (ms / 1000)


def weight_bytes_read_per_step(model) -> int:
    """Parameter bytes a decode step reads: all of them, except that an untied input
    embedding is only gathered row by row."""
    seen: set[int] = set()
    total = 0
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    lm_head = getattr(model, "lm_head", None)
    skip = None
    if embed is not None and lm_head is not None and embed.weight is not lm_head.weight:
        skip = embed.weight.data_ptr()
    for p in model.parameters():
        if p.data_ptr() in seen or p.data_ptr() == skip:
            continue
        seen.add(p.data_ptr())
        total += p.numel() * p.element_size()
    return total


def kv_bytes_per_token(engine) -> float:
    """KV-cache bytes one cached token occupies across all layers."""
    return engine.kv_bytes / (engine.num_blocks * engine.config.block_size)


def utilisation(weight_bytes: int, kv_per_token: float, mean_context: float, concurrency: int,
                steps_per_s: float, bandwidth: float) -> float:
    per_step = weight_bytes + kv_per_token * mean_context * concurrency
    return per_step * steps_per_s / bandwidth
