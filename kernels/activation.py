"""Reference gated activation of SwiGLU MLPs."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``x = [gate | up]`` [T, 2I] -> [T, I], in float32, cast back.

    Gate and up projections are fused into one matmul upstream, hence the halves.
    """
    gate, up = x.float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(x.dtype)
