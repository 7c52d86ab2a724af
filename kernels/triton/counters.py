"""Zeroed int32 counters for kernels whose last program to finish does the final step.

Decode attention (the split that finishes last merges the partials) and the Gated
DeltaNet decode kernel (the value head that finishes last writes the shared q/k conv
history) count arrivals with an atomic add and reset their counter afterwards, so the
buffer is zero again for the next launch. Each kernel keeps its own buffer per device,
allocated on first use (warm-up runs before any CUDA graph is captured) and grown,
never freed: a captured graph keeps using the address it saw, and graphs hold no
reference of their own to memory allocated outside their pool.
"""

from __future__ import annotations

import torch

_buffers: dict[tuple[str, torch.device], torch.Tensor] = {}
#: every buffer ever handed out, kept alive for the graphs that captured it
_retired: list[torch.Tensor] = []


def counter_buffer(owner: str, device: torch.device, needed: int, minimum: int) -> torch.Tensor:
    """At least ``needed`` (and ``minimum``) zeroed counters for kernel ``owner`` on ``device``."""
    key = (owner, device)
    buf = _buffers.get(key)
    if buf is None or buf.numel() < needed:
        if buf is not None:
            _retired.append(buf)
        buf = torch.zeros(max(needed, minimum), dtype=torch.int32, device=device)
        _buffers[key] = buf
    return buf
