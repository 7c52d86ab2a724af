"""Round-to-nearest quantizers: a dense weight ``[N, K]`` -> one of the in-memory layouts.

They make ``ninfer-make-tiny --quant`` checkpoints (each format's writer then spells the
result the way its checkpoints store it) and measure what each format costs in accuracy.
They follow the published recipes' arithmetic without calibration (no GPTQ error feedback,
no AWQ activation-aware scaling): a tiny random model has no activations worth calibrating on.
"""

from __future__ import annotations

import torch

from ninfer_kernels.kv_quant import e2m1_codes
from ninfer_kernels.quant_formats import Fp8Block, Int4Group, Nvfp4, zeros_are_eight
from ninfer_plugins.weights.packing import pack_e2m1, pack_int4

FP8_MAX = 448.0
E2M1_MAX = 6.0  # the largest e2m1 value
_TINY = 1e-12


def _blocks(w: torch.Tensor, bn: int, bk: int) -> torch.Tensor:
    """``w`` padded to whole blocks, as ``[N/bn, bn, K/bk, bk]``."""
    n, k = w.shape
    padded = torch.nn.functional.pad(w, (0, -k % bk, 0, -n % bn))
    return padded.reshape(padded.shape[0] // bn, bn, padded.shape[1] // bk, bk)


def fp8_block(w: torch.Tensor, block: tuple[int, int]) -> Fp8Block:
    """e4m3 values with one fp32 scale per ``block`` (``(1, K)`` is per output channel)."""
    n, k = w.shape
    bn, bk = block
    tiles = _blocks(w.float(), bn, bk)
    scale = (tiles.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=_TINY)
    q = (tiles / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    q = q.reshape(tiles.shape[0] * bn, tiles.shape[2] * bk)[:n, :k].contiguous()
    return Fp8Block(q, scale, (bn, bk))


def int4_group(w: torch.Tensor, group_size: int, symmetric: bool, zero: int = 8,
               sym_levels: float = 7.5) -> Int4Group:
    """4-bit codes per ``group_size`` inputs. Asymmetric: scale ``(max - min) / 15`` and an
    integer zero point; symmetric: zero ``zero`` and scale ``absmax / sym_levels`` (GPTQ
    spreads ``[-absmax, absmax]`` over all 15 steps: ``sym_levels`` 7.5, as compressed-tensors does)."""
    n, k = w.shape
    g = w.float().reshape(n, k // group_size, group_size)
    if symmetric:
        scale = (g.abs().amax(dim=-1) / sym_levels).clamp(min=_TINY)
        zeros = torch.full_like(scale, float(zero))
    else:
        low, high = g.amin(dim=-1).clamp(max=0), g.amax(dim=-1).clamp(min=0)
        scale = ((high - low) / 15).clamp(min=_TINY)
        zeros = (-low / scale).round().clamp(0, 15)
    codes = (g / scale[..., None] + zeros[..., None]).round().clamp(0, 15).reshape(n, k)
    return Int4Group(pack_int4(codes), scale, zeros, group_size, symmetric=zeros_are_eight(zeros))


def nvfp4(w: torch.Tensor, alpha: float | None = None) -> Nvfp4:
    """e2m1 values, an e4m3 scale per 16 inputs and one fp32 ``alpha`` (by default the one
    that puts the largest block scale at e4m3's maximum, as ModelOpt and llm-compressor do;
    fused shards pass a shared one)."""
    n, k = w.shape
    w = w.float()
    if alpha is None:
        alpha = nvfp4_alpha(w)
    blocks = w.reshape(n, k // 16, 16)
    scale = (blocks.abs().amax(dim=-1) / E2M1_MAX / alpha).clamp(max=FP8_MAX).to(torch.float8_e4m3fn)
    step = (scale.float() * alpha).clamp(min=_TINY)[..., None]
    codes = e2m1_codes(blocks / step).reshape(n, k)
    return Nvfp4(pack_e2m1(codes), scale, torch.tensor(alpha, dtype=torch.float32))


def nvfp4_alpha(*weights: torch.Tensor) -> float:
    amax = max(float(w.abs().max()) for w in weights)
    return max(amax, _TINY) / (E2M1_MAX * FP8_MAX)
