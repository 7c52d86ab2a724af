"""Quantized KV-cache formats: ``int8``, ``fp8``, ``nvfp4`` and ``k8v4`` (fp8 keys, nvfp4 values).

Each layer's cache keeps, for keys and for values, the parts of its codec
(:mod:`ninfer_kernels.kv_quant`): the quantized values and their scales, every part paged
``[num_blocks, block_size, num_kv_heads, width]`` so a page moves whole (one-byte value
codes are stored keys-contiguous per dim behind that view: ``allocate_parts``). New keys and
values are quantized as they are written; attention reads the quantized pages and
dequantizes them as it goes (:func:`ninfer_kernels.ops.paged_attention_quant`), so no
full-precision copy of the cache exists. Layouts and bytes per token: docs/kv-formats.md.
"""

from __future__ import annotations

from typing import Callable

import torch
from loguru import logger

from ninfer.hookspecs import hookimpl
from ninfer.model.forward_batch import ForwardBatch
from ninfer.model.kv import HeadNormRope, KVCache, KVDtype
from ninfer_kernels import kv_quant, ops

#: the per-tensor scale nvfp4 block scales are relative to: block scales then span
#: amax 0.012 .. 2688 per 16 elements in e4m3's normal and subnormal range
NVFP4_GLOBAL_SCALE = 1.0


class QuantizedKVCache(KVCache):
    def __init__(self, k_codec: kv_quant.KVCodec, v_codec: kv_quant.KVCodec, num_blocks: int, block_size: int,
                 num_kv_heads: int, head_dim: int, device: torch.device | str):
        for codec in (k_codec, v_codec):
            kv_quant.check_head_dim(codec, head_dim)
        self.k_codec, self.v_codec = k_codec, v_codec
        # zeroed (not empty): kernels may read a page's unused tail before masking it
        shape = (num_blocks, block_size, num_kv_heads, head_dim, device)
        self.k_parts = kv_quant.allocate_parts(k_codec, *shape)
        self.v_parts = kv_quant.allocate_parts(v_codec, *shape, values=True)

    def write(self, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        ops.write_kv_quant(self.k_parts, self.v_parts, self.k_codec, self.v_codec, k, v, slot_mapping)

    def attend(self, q: torch.Tensor, batch: ForwardBatch, scale: float) -> torch.Tensor:
        return ops.paged_attention_quant(q, self.k_parts, self.v_parts, self.k_codec, self.v_codec, batch, scale)

    def decode_fused(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, norm_rope: HeadNormRope,
                     batch: ForwardBatch, scale: float, gate: torch.Tensor | None = None) -> torch.Tensor | None:
        """Decode batches on CUDA: norm, RoPE, the quantized write and attention in one launch
        (where the steps take four: :mod:`ninfer_kernels.triton.kv_quant_decode`)."""
        if batch.max_query_len != 1 or not ops.has_triton("decode_attention_quant") or q.device.type != "cuda":
            return None
        return ops.decode_attention_quant(q, k, v, norm_rope, self.k_parts, self.v_parts, self.k_codec, self.v_codec,
                                          batch, scale, gate)

    @property
    def capturable(self) -> bool:
        # the reference attention walks the batch's host-side lists: only kernels capture
        return ops.has_triton("paged_attention_quant")

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.page_tensors())

    def page_tensors(self) -> list[torch.Tensor]:
        return [kv_quant.page_storage(p) for p in (*self.k_parts, *self.v_parts)]


def _format(name: str, description: str, k_codec: kv_quant.KVCodec, v_codec: kv_quant.KVCodec) -> KVDtype:
    warned = []  # once per format, not once per layer

    def allocate(num_blocks, block_size, num_kv_heads, head_dim, model_dtype, device) -> QuantizedKVCache:
        if torch.device(device).type == "cuda" and not ops.has_triton("paged_attention_quant") and not warned:
            warned.append(True)
            logger.warning("kv_dtype {}: no CUDA kernel reads this format (Triton missing, or NINFER_KERNELS="
                           "reference); attention runs the reference, which dequantizes each sequence's pages per "
                           "step", name)
        return QuantizedKVCache(k_codec, v_codec, num_blocks, block_size, num_kv_heads, head_dim, device)

    def bytes_per_token(model_dtype: torch.dtype, num_kv_heads: int, head_dim: int) -> float:
        return num_kv_heads * (k_codec.bytes_per_head(head_dim) + v_codec.bytes_per_head(head_dim))

    return KVDtype(name=name, description=description, bytes_per_token=bytes_per_token, allocate=allocate)


NVFP4 = kv_quant.nvfp4(NVFP4_GLOBAL_SCALE)
FORMATS = (
    _format("int8", "int8 K/V, one float32 scale per 64 elements", kv_quant.INT8, kv_quant.INT8),
    _format("fp8", "float8 e4m3 K/V, one float32 scale per token and head", kv_quant.FP8, kv_quant.FP8),
    _format("nvfp4", "e2m1 K/V, an e4m3 scale per 16 elements and a float32 per-tensor scale", NVFP4, NVFP4),
    _format("k8v4", "fp8 keys (as fp8) and nvfp4 values (as nvfp4)", kv_quant.FP8, NVFP4),
)


@hookimpl
def register_kv_dtypes(register: Callable[[KVDtype], None]) -> None:
    for fmt in FORMATS:
        register(fmt)
