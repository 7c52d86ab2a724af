"""Reference codecs for quantized KV caches: how one token's head is stored and read back.

A codec turns a key or value head ``x`` [..., D] into a few tensors ("parts") whose last
dimension is per head and whose leading dimensions follow ``x``, and back. The paged
cache stores each part as ``[num_blocks, block_size, num_kv_heads, width]``, so a page
of every part moves as one (host tier, prefix reuse) and a kernel finds a token's
scales beside its values. Values in a one-byte format keep a page's keys contiguous per
head dim (:func:`allocate_parts`); the part is then a permuted view and indexes the same
way. All codecs are symmetric (no zero point):

* ``int8``: int8 values, one float32 scale per 64 elements (``amax / 127``; per head when
  the head is narrower).
* ``fp8``: float8 e4m3 values, one float32 scale per token and head (``amax / 448``).
  A scale per page would have to be fixed before the page's later tokens exist (or the
  page re-quantized as they arrive); per token it is exact for every token, for 4 bytes
  per head and token (docs/kv-formats.md has the measured comparison).
* ``nvfp4``: e2m1 values (two per byte, the even element in the low nibble), one float8
  e4m3 scale per 16 elements, and one float32 scale for the whole cache tensor (set at
  allocation, 1.0 by default) that the block scales are relative to.

These are the oracle the Triton kernels are checked against; rounding is to nearest,
ties to even, everywhere (as the hardware conversions do).
"""

from __future__ import annotations

from typing import Callable, Sequence

import attrs
import torch

from ninfer.model.forward_batch import ForwardBatch
from ninfer_kernels.attention import attend_pages, gather_pages, output_gate

INT8_GROUP = 64
FP8_MAX = 448.0  # largest finite float8 e4m3 value
NVFP4_GROUP = 16
E2M1_MAX = 6.0
#: the eight magnitudes of e2m1 in code order (code = sign << 3 | index)
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


@attrs.frozen
class KVCodec:
    """One stored form of a K or V head of ``head_dim`` elements."""

    name: str
    #: (width, dtype) of each part for a head of ``head_dim`` elements
    layout: Callable[[int], list[tuple[int, torch.dtype]]]
    quantize: Callable[[torch.Tensor], list[torch.Tensor]]
    dequantize: Callable[[Sequence[torch.Tensor]], torch.Tensor]
    #: elements sharing one scale, for a head of ``head_dim`` elements
    group: Callable[[int], int] = lambda head_dim: head_dim
    #: the per-tensor scale the stored scales are relative to (nvfp4's; 1 for the others)
    global_scale: float = 1.0
    #: one code a byte, so the codes may be stored in any order along the head dims
    byte_codes: bool = False

    def bytes_per_head(self, head_dim: int) -> int:
        return sum(w * dtype.itemsize for w, dtype in self.layout(head_dim))


# -- int8 ----------------------------------------------------------------------------------
def int8_group(head_dim: int) -> int:
    return min(INT8_GROUP, head_dim)


# Divisions by a constant are written as products with its reciprocal: torch's CPU divides
# exactly and its CUDA kernels multiply by the reciprocal, one float32 step apart, and the
# Triton kernels must store the same bytes as this reference on both.
def quantize_int8(x: torch.Tensor) -> list[torch.Tensor]:
    """[int8 values [..., D], float32 scales [..., D / group]]."""
    g = x.float().unflatten(-1, (-1, int8_group(x.shape[-1])))
    scale = g.abs().amax(dim=-1) * (1.0 / 127.0)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(g / safe.unsqueeze(-1)).clamp(-127, 127).to(torch.int8)
    return [q.flatten(-2), scale]


def dequantize_int8(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    q, scale = parts
    return (q.float().unflatten(-1, (scale.shape[-1], -1)) * scale.unsqueeze(-1)).flatten(-2)


# -- fp8 -----------------------------------------------------------------------------------
def quantize_fp8(x: torch.Tensor) -> list[torch.Tensor]:
    """[float8 e4m3 values [..., D], float32 scale [..., 1]] per token and head."""
    xf = x.float()
    scale = xf.abs().amax(dim=-1, keepdim=True) * (1.0 / FP8_MAX)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    # never a NaN code (e4m3fn's only special value): the GPU kernels read a page's slots
    # past a sequence's end unmasked, where a zero probability meets the code
    codes = torch.nan_to_num(xf / safe, nan=0.0).clamp(-FP8_MAX, FP8_MAX)
    return [codes.to(torch.float8_e4m3fn), scale]


def dequantize_fp8(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    q, scale = parts
    return q.float() * scale


# -- nvfp4 ---------------------------------------------------------------------------------
def e2m1_codes(y: torch.Tensor) -> torch.Tensor:
    """int64 e2m1 codes of float32 ``y`` (already scaled; magnitudes past 6 saturate),
    rounded to the nearest value, ties to the even code."""
    a = y.abs().clamp(max=E2M1_MAX)
    values = torch.tensor(E2M1_VALUES, device=y.device)
    mids = (values[1:] + values[:-1]) / 2
    index = torch.bucketize(a, mids)  # a == mids[i] lands on i: the lower neighbour
    tie = (index < len(mids)) & (a == mids[index.clamp(max=len(mids) - 1)])
    index = torch.where(tie & (index % 2 == 1), index + 1, index)
    return torch.where(y < 0, index | 8, index)


def quantize_nvfp4(x: torch.Tensor, global_scale: float = 1.0) -> list[torch.Tensor]:
    """[uint8 packed e2m1 pairs [..., D / 2], float8 e4m3 block scales [..., D / 16]]."""
    g = x.float().unflatten(-1, (-1, NVFP4_GROUP)) * (1.0 / global_scale)
    block = (g.abs().amax(dim=-1) * (1.0 / E2M1_MAX)).clamp(max=FP8_MAX).to(torch.float8_e4m3fn)
    bf = block.float().unsqueeze(-1)
    y = torch.where(bf > 0, g / torch.where(bf > 0, bf, torch.ones_like(bf)), torch.zeros_like(g))
    codes = e2m1_codes(y).flatten(-2)
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)
    return [packed, block]


def dequantize_nvfp4(parts: Sequence[torch.Tensor], global_scale: float = 1.0) -> torch.Tensor:
    packed, block = parts
    p = packed.to(torch.int64)
    codes = torch.stack([p & 15, p >> 4], dim=-1).flatten(-2)
    values = torch.tensor(E2M1_VALUES, device=packed.device)[codes & 7]
    values = torch.where(codes >= 8, -values, values)
    scaled = values.unflatten(-1, (-1, NVFP4_GROUP)) * block.float().unsqueeze(-1) * global_scale
    return scaled.flatten(-2)


# -- the codecs ------------------------------------------------------------------------------
INT8 = KVCodec(
    "int8", lambda d: [(d, torch.int8), (d // int8_group(d), torch.float32)], quantize_int8, dequantize_int8,
    int8_group, byte_codes=True,
)
FP8 = KVCodec("fp8", lambda d: [(d, torch.float8_e4m3fn), (1, torch.float32)], quantize_fp8, dequantize_fp8,
              byte_codes=True)


def nvfp4(global_scale: float = 1.0) -> KVCodec:
    """The nvfp4 codec for a cache tensor whose block scales are relative to ``global_scale``."""
    return KVCodec(
        "nvfp4", lambda d: [(d // 2, torch.uint8), (d // NVFP4_GROUP, torch.float8_e4m3fn)],
        lambda x: quantize_nvfp4(x, global_scale), lambda parts: dequantize_nvfp4(parts, global_scale),
        lambda d: NVFP4_GROUP, global_scale,
    )


def allocate_parts(codec: KVCodec, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                   device: torch.device | str, values: bool = False) -> list[torch.Tensor]:
    """A cache's zeroed parts for ``codec``, each indexed ``[num_blocks, block_size,
    num_kv_heads, width]``. ``values``: the value side, whose one-byte codes are stored
    ``[num_blocks, num_kv_heads, width, block_size]`` and handed out as a permuted view of
    that (:func:`page_storage` gives it back). The value product runs along the keys; with
    each key's dims contiguous instead, the GPU kernel fed Hopper's MMA from single-byte
    shared-memory reads (docs/kv-formats.md, session 15)."""
    parts = []
    for i, (width, dtype) in enumerate(codec.layout(head_dim)):
        if i == 0 and values and codec.byte_codes:
            storage = torch.zeros(num_blocks, num_kv_heads, width, block_size, dtype=dtype, device=device)
            parts.append(storage.permute(0, 3, 1, 2))
        else:
            parts.append(torch.zeros(num_blocks, block_size, num_kv_heads, width, dtype=dtype, device=device))
    return parts


def page_storage(part: torch.Tensor) -> torch.Tensor:
    """The contiguous tensor behind a part, pages first (what the host tier copies byte for byte)."""
    return part if part.is_contiguous() else part.permute(0, 2, 3, 1)


def write_kv_quant(k_parts: Sequence[torch.Tensor], v_parts: Sequence[torch.Tensor], k_codec: KVCodec,
                   v_codec: KVCodec, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Quantize ``k``/``v`` [T, Hk, D] and store each part at flat slots [T] (-1: skip)."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    for parts, codec, x in ((k_parts, k_codec, k), (v_parts, v_codec, v)):
        for store, value in zip(parts, codec.quantize(x[keep])):
            if store.dtype.itemsize == 1 and store.dtype.is_floating_point:  # float8: copy the bytes
                store, value = store.view(torch.uint8), value.view(torch.uint8)
            page_size = store.shape[1]
            store[slots // page_size, slots % page_size] = value


def paged_attention_quant(q: torch.Tensor, k_parts: Sequence[torch.Tensor], v_parts: Sequence[torch.Tensor],
                          k_codec: KVCodec, v_codec: KVCodec, batch, scale: float) -> torch.Tensor:
    """:func:`ninfer_kernels.attention.paged_attention` over quantized pages: each sequence's
    pages are gathered and dequantized (this reference materialises them; kernels do not)."""
    def reader(parts, codec):
        return lambda table, seq_len: codec.dequantize([gather_pages(p, table, seq_len) for p in parts])

    return attend_pages(q, reader(k_parts, k_codec), reader(v_parts, v_codec), k_parts[0].shape[2], batch, scale)


def check_head_dim(codec: KVCodec, head_dim: int) -> None:
    """A codec's groups must tile the head exactly."""
    group = codec.group(head_dim)
    if head_dim % group:
        raise ValueError(f"KV format {codec.name} groups {group} elements: head_dim {head_dim} is not a multiple")


def decode_attention_quant(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, norm_rope,
                           k_parts: Sequence[torch.Tensor], v_parts: Sequence[torch.Tensor], k_codec: KVCodec,
                           v_codec: KVCodec, batch: ForwardBatch, scale: float,
                           gate: torch.Tensor | None = None) -> torch.Tensor:
    """A decode batch from the raw projections to attention output: per-head q/k norm and
    RoPE (``norm_rope``: a :class:`ninfer.model.kv.HeadNormRope`), the quantized write of the
    new k/v at ``batch.slot_mapping``, then attention over the pages (what
    :func:`ninfer_kernels.decode_attention.decode_attention` does for a plain cache). One
    launch on CUDA. ``gate``: as for the plain cache's decode."""
    from ninfer_kernels.qk_norm_rope import qk_norm_rope

    n = norm_rope
    q, k = qk_norm_rope(q, k, n.q_weight, n.k_weight, n.eps, n.positions, n.cos_sin, n.rotary_dim)
    write_kv_quant(k_parts, v_parts, k_codec, v_codec, k, v, batch.slot_mapping)
    return output_gate(paged_attention_quant(q, k_parts, v_parts, k_codec, v_codec, batch, scale), gate)
