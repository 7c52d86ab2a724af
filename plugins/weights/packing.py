"""4-bit packing as each checkpoint format spells it, to and from plain integer tensors.

Everything here works on unsigned 4-bit codes 0..15 held in int32 tensors:

* ours (:class:`ninfer_kernels.quant_formats.Int4Group`) and compressed-tensors' weights:
  eight codes per int32 along the last dimension, code ``j`` in bits ``4j..4j+3``;
* GPTQ's ``qweight`` packs eight *rows* (input features) per int32 the same way, its
  ``qzeros`` eight columns;
* AWQ packs eight columns (output features) per int32 in the interleaved order
  ``AWQ_ORDER``: bits ``4i..4i+3`` hold column ``AWQ_ORDER[i]`` of the eight (the order its
  GEMM kernel dequantizes in);
* NVFP4 puts two e2m1 codes in a byte, the even column in the low nibble.
"""

from __future__ import annotations

import torch

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)


def pack_int4(codes: torch.Tensor, dim: int = -1, order: tuple[int, ...] = tuple(range(8))) -> torch.Tensor:
    """Codes 0..15 -> int32 with eight codes per word along ``dim``; bits ``4i`` hold the
    ``order[i]``-th code of each eight."""
    codes = codes.to(torch.int32).movedim(dim, -1)
    if codes.shape[-1] % 8:
        raise ValueError(f"packing 4-bit codes needs a multiple of 8 along dim {dim}, got {codes.shape[-1]}")
    groups = codes.reshape(*codes.shape[:-1], -1, 8)[..., list(order)]
    packed = (groups << _SHIFTS.to(codes.device)).sum(dim=-1, dtype=torch.int64)
    packed = torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)  # the bit pattern, as int32
    return packed.movedim(-1, dim)


def unpack_int4(packed: torch.Tensor, dim: int = -1, order: tuple[int, ...] = tuple(range(8))) -> torch.Tensor:
    """The inverse of :func:`pack_int4`: int32 words -> codes 0..15 (int32), 8x longer along ``dim``."""
    words = packed.to(torch.int32).movedim(dim, -1)
    nibbles = (words.unsqueeze(-1) >> _SHIFTS.to(words.device)) & 0xF
    codes = torch.empty_like(nibbles)
    codes[..., list(order)] = nibbles
    return codes.flatten(-2).movedim(-1, dim)


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """e2m1 codes 0..15 ``[.., K]`` -> uint8 ``[.., K // 2]``, even columns in the low nibble."""
    codes = codes.to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4)
