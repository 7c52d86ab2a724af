"""Memory-bandwidth figures: what the device can copy, and what a decode step must read.

Decode at low concurrency is bound by memory traffic: every step reads the weights it
uses once (for MoE blocks, only the experts its tokens reach: exactly top-k at one
token, and for more tokens the number uniform routing reaches on average, as random
weights route), each sequence's cached keys and values, and reads and writes each
sequence's recurrent state (hybrid families). Utilisation is that traffic times the
step rate over the bandwidth a plain device-to-device copy reaches.
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


def weight_bytes_read_per_step(model, num_seqs: int = 1) -> int:
    """Parameter bytes a decode step of ``num_seqs`` sequences reads.

    Every parameter once, except: an untied input embedding is only gathered row by row;
    a module that knows its own traffic (``weight_bytes_read(num_tokens)``: MoE blocks,
    which read only the experts their tokens are routed to) reports it; and the MTP head,
    which plain decode never runs, counts nothing.
    """
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    lm_head = getattr(model, "lm_head", None)
    seen: set[int] = set()
    if embed is not None and lm_head is not None and embed.weight is not lm_head.weight:
        seen.add(embed.weight.data_ptr())
    skipped = getattr(model, "mtp", None)
    if skipped is not None:
        seen.update(p.data_ptr() for p in skipped.parameters())
    total = 0
    for module in model.modules():
        if hasattr(module, "weight_bytes_read"):
            total += module.weight_bytes_read(num_seqs)
            seen.update(p.data_ptr() for p in module.parameters())
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total


def state_bytes_per_step(model, num_seqs: int) -> int:
    """Recurrent-state bytes a decode step reads and writes (hybrid families; 0 otherwise)."""
    return 2 * model.state_bytes_per_slot() * num_seqs


def kv_bytes_per_token(engine) -> float:
    """KV-cache bytes one cached token occupies across all layers."""
    return engine.kv_bytes / (engine.num_blocks * engine.config.block_size)


def utilisation(bytes_per_step: float, steps_per_s: float, bandwidth: float) -> float:
    return bytes_per_step * steps_per_s / bandwidth
