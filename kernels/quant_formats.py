"""Quantized weights in memory: the three layouts every checkpoint format is converted to.

Loaders (the weight-format plugins) convert what a checkpoint stores (Qwen's FP8 block,
compressed-tensors, ModelOpt, AWQ, GPTQ) into one of these at load time, so kernels
know three layouts instead of six. Leading dimensions are allowed: a stacked MoE
projection is ``[E, N, K]`` with scales ``[E, ...]``. ``N`` is the output dimension,
``K`` the input (reduction) dimension, as in a checkpoint's ``[out, in]`` weight.

``dequantize`` is the reference: the exact real-valued weight the format encodes, which
the CPU path multiplies with and the Triton kernels are tested against.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# e2m1 code (low 3 bits magnitude, bit 3 sign) -> value
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


@dataclass
class Fp8Block:
    """``weight`` float8_e4m3fn ``[.., N, K]``; ``scale`` fp32 ``[.., ceil(N/bn), ceil(K/bk)]``.

    Real weight = ``weight * scale`` of its ``block = (bn, bk)`` tile. Qwen's FP8 checkpoints
    are ``(128, 128)`` (their ``weight_scale_inv`` multiplies, despite the name); a
    per-channel scale is ``(1, K)``. Activations are quantized at run time per token (per
    ``bk`` group) by the kernels; the reference multiplies in the activation dtype.
    """

    weight: torch.Tensor
    scale: torch.Tensor
    block: tuple[int, int]

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        bn, bk = self.block
        n, k = self.weight.shape[-2:]
        s = self.scale.float().repeat_interleave(bn, dim=-2)[..., :n, :]
        s = s.repeat_interleave(bk, dim=-1)[..., :k]
        return (self.weight.float() * s).to(dtype)


@dataclass
class Int4Group:
    """4-bit integers with a scale and zero point per ``group_size`` inputs (AWQ, GPTQ, W4A16).

    ``qweight`` int32 ``[.., N, K // 8]``: nibble ``j`` (bits ``4j..4j+3``) of word ``w`` is
    column ``8 * w + j``, unsigned 0..15. ``scales`` and ``zeros`` ``[.., N, K // group_size]``
    in the activation dtype; real weight = ``(q - zero) * scale`` (a symmetric format has
    zero 8). Zero points are whole numbers in every layout loaded (the packed one-row CUDA
    kernel, ``triton/int4_fp16.py``, relies on it).

    ``symmetric``: every zero point is 8 (GPTQ with ``sym``, compressed-tensors' symmetric
    W4A16, and whatever else turns out so when loaded: :func:`zeros_are_eight`). The CUDA
    kernels then take 8 as a constant and read no zero points: fewer bytes a step and
    fewer instructions a weight. False is always correct, only slower.
    """

    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    group_size: int
    symmetric: bool = False

    @property
    def shape(self) -> torch.Size:
        return torch.Size((*self.qweight.shape[:-1], self.qweight.shape[-1] * 8))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        shifts = torch.arange(0, 32, 4, device=self.qweight.device, dtype=torch.int32)
        q = (self.qweight.unsqueeze(-1) >> shifts) & 0xF
        q = q.flatten(-2).float()
        g = self.group_size
        s = self.scales.float().repeat_interleave(g, dim=-1)
        z = self.zeros.float().repeat_interleave(g, dim=-1)
        return ((q - z) * s).to(dtype)


def zeros_are_eight(zeros: torch.Tensor) -> bool:
    """Whether every zero point is 8 (a symmetric int4 weight); reads the tensor, so call
    it when loading, not per step."""
    return bool((zeros == 8).all())


@dataclass
class Nvfp4:
    """e2m1 values with an e4m3 scale per 16 inputs and one fp32 factor (NVFP4).

    ``packed`` uint8 ``[.., N, K // 2]``: the low nibble is column ``2i``, the high one
    ``2i + 1``. ``scale`` float8_e4m3fn ``[.., N, K // 16]``. ``alpha`` fp32, shape ``[]`` or
    ``[E]`` for stacked experts. Real weight = ``e2m1 * scale * alpha``: ModelOpt's
    ``weight_scale_2`` is ``alpha``; compressed-tensors' ``weight_global_scale`` is
    ``1 / alpha``.
    """

    packed: torch.Tensor
    scale: torch.Tensor
    alpha: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return torch.Size((*self.packed.shape[:-1], self.packed.shape[-1] * 2))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        table = torch.tensor(E2M1_VALUES, device=self.packed.device)
        p = self.packed.to(torch.int32)
        q = torch.stack((table[p & 0xF], table[p >> 4]), dim=-1).flatten(-2)
        s = self.scale.float().repeat_interleave(16, dim=-1)
        a = self.alpha.float().reshape(*self.alpha.shape, *([1] * (q.dim() - self.alpha.dim())))
        return (q * s * a).to(dtype)


QuantWeight = Fp8Block | Int4Group | Nvfp4


def quant_linear(x: torch.Tensor, weight: QuantWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Reference ``y = x W^T (+ b)`` for a quantized ``W``: dequantize, then multiply."""
    return torch.nn.functional.linear(x, weight.dequantize(x.dtype), bias)
