"""Reference rotary position embedding (rotate-half / neox layout, as in HF Llama/Qwen).

A head's first ``rotary_dim`` dims are split in two halves ``(x1, x2)`` that rotate
as pairs ``(x1[i], x2[i])``; any dims past ``rotary_dim`` pass through unchanged
(partial rotary). Positions are 1-D token indices (text).
"""

from __future__ import annotations

import torch

#: RoPE scaling types whose frequencies are implemented here
SUPPORTED_SCALING = ("default", "linear")


def _inv_freq(rotary_dim: int, base: float, scaling: dict | None) -> torch.Tensor:
    # Same expression and op order as transformers, so float32 tables match bit for bit.
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float) / rotary_dim))
    if not scaling:
        return inv_freq
    # Hugging Face configs name the type "rope_type" (newer) or "type" (older).
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    raise ValueError(
        f"unsupported RoPE scaling type {kind!r} (supported: {', '.join(SUPPORTED_SCALING)})"
    )


def rope_cos_sin(
    max_positions: int,
    rotary_dim: int,
    base: float,
    dtype: torch.dtype,
    device: torch.device | str,
    scaling: dict | None = None,
) -> torch.Tensor:
    """Table [max_positions, rotary_dim]: cos in the first half, sin in the second.

    One row per position, computed in float32 and stored in ``dtype``.
    """
    if rotary_dim % 2:
        raise ValueError(f"rotary_dim must be even, got {rotary_dim}")
    inv_freq = _inv_freq(rotary_dim, base, scaling)
    freqs = torch.arange(max_positions, dtype=torch.float)[:, None] * inv_freq[None, :]
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(dtype=dtype, device=device)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int) -> torch.Tensor:
    """Rotate the first ``rotary_dim`` dims of ``x`` [T, H, D]; cos/sin are [T, 1, rotary_dim/2]."""
    half = rotary_dim // 2
    xf = x.float()
    x1, x2 = xf[..., :half], xf[..., half:rotary_dim]
    rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)
    if rotary_dim == x.shape[-1]:
        return rotated
    return torch.cat([rotated, x[..., rotary_dim:]], dim=-1)


def apply_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    rotary_dim: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [T, H, D] and k [T, Hk, D] by their token ``positions`` [T]; returns new tensors.

    ``cos_sin`` comes from :func:`rope_cos_sin` with the same ``rotary_dim``; the math
    runs in float32 and each result keeps its input's dtype.
    """
    if cos_sin.shape[-1] != rotary_dim:
        raise ValueError(f"cos_sin table has {cos_sin.shape[-1]} columns, expected rotary_dim={rotary_dim}")
    cos, sin = cos_sin[positions].float().unsqueeze(1).chunk(2, dim=-1)
    return _rotate(q, cos, sin, rotary_dim), _rotate(k, cos, sin, rotary_dim)
