"""The built-in unquantized KV-cache format, registered as ``bf16``.

Keys and values are stored exactly as the model computes them. Production models
compute in bfloat16, hence the name; a model run in float32 or float16 (parity tests,
small CPU runs) stores that dtype instead, so its cached values are bit-identical to
what it produced and comparisons against an uncached oracle stay exact.
"""

from __future__ import annotations

from typing import Callable

import torch

from ninfer.hookspecs import hookimpl
from ninfer.model.forward_batch import ForwardBatch
from ninfer.model.kv import HeadNormRope, KVCache, KVDtype
from ninfer_kernels import ops
from ninfer_kernels.decode_attention import fits_rows


class NativeKVCache(KVCache):
    """Paged K and V tensors [num_blocks, block_size, num_kv_heads, head_dim] in the model dtype."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        model_dtype: torch.dtype,
        device: torch.device | str,
    ):
        if not model_dtype.is_floating_point:
            raise ValueError(f"bf16 KV cache needs a floating-point model dtype, got {model_dtype}")
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        # Zeroed, not empty: kernels may load a whole page before masking the unused
        # tail, and uninitialised NaNs would survive a multiply by a zero weight.
        self.k = torch.zeros(shape, dtype=model_dtype, device=device)
        self.v = torch.zeros(shape, dtype=model_dtype, device=device)

    def write(self, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        ops.write_kv(self.k, self.v, k, v, slot_mapping)

    def attend(self, q: torch.Tensor, batch: ForwardBatch, scale: float) -> torch.Tensor:
        return ops.paged_attention(q, self.k, self.v, batch, scale)

    def attend_gated(self, q: torch.Tensor, batch: ForwardBatch, scale: float, gate: torch.Tensor) -> torch.Tensor:
        return ops.paged_attention(q, self.k, self.v, batch, scale, gate)

    def decode_fused(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, norm_rope: HeadNormRope,
        batch: ForwardBatch, scale: float, gate: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        # decode steps, and steps whose sequences each bring the same few rows (speculative
        # verify rows, the MTP head's extend) when the one-launch kernel's tile holds them
        rows = batch.max_query_len
        if not (rows == 1 or batch.rows_per_seq == rows) or not fits_rows(q.shape[1] // self.k.shape[2], rows):
            return None
        n = norm_rope
        return ops.decode_attention(q, k, v, n.q_weight, n.k_weight, n.eps, n.positions, n.cos_sin, n.rotary_dim,
                                    self.k, self.v, batch, scale, gate)

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def page_tensors(self) -> list[torch.Tensor]:
        return [self.k, self.v]


def _bytes_per_token(model_dtype: torch.dtype, num_kv_heads: int, head_dim: int) -> float:
    return float(2 * num_kv_heads * head_dim * model_dtype.itemsize)


NATIVE = KVDtype(
    name="bf16",
    description="unquantized K/V in the model's compute dtype (bf16 in production)",
    bytes_per_token=_bytes_per_token,
    allocate=NativeKVCache,
)


@hookimpl
def register_kv_dtypes(register: Callable[[KVDtype], None]) -> None:
    register(NATIVE)
