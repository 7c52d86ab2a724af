"""Launch shapes for :mod:`.quant_gemm`: the config a product runs with, from a per-device
table ``quant_configs/<device>.json`` (written by scripts/gpu_quant_gemm_sweep.py: format
and shape -> row count -> config; a shape the table lacks borrows the nearest tuned N),
else :func:`heuristic_config`. Host-side, from shapes only, so CUDA graphs replay the
choice."""

from __future__ import annotations

import functools
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import triton

from ninfer_kernels.triton.quant_tiles import FP8, INT4, NVFP4
from ninfer_kernels.triton.tuned_tables import device_name, read_table

CONFIG_DIR = Path(__file__).parent / "quant_configs"
#: most rows the decode heuristic treats as weight-streaming
DECODE_ROWS = 64
#: rows from which the heuristic dequantizes int4 and NVFP4 weights for cuBLAS
#: (:mod:`.cublas_prefill`): there one pass over the weight costs less than rebuilding it
#: in every row tile (about 0.2 ms for the 27B's widest projection, against 0.5 ms of
#: bf16 product at 1,024 rows on an H100)
DENSE_ROWS = 1024


@dataclass(frozen=True)
class QuantGemmConfig:
    BLOCK_M: int
    BLOCK_N: int
    BLOCK_K: int
    SPLITS: int = 1
    GROUP_M: int = 8
    num_warps: int = 4
    num_stages: int = 3
    #: FP8 only: quantize x and multiply on the FP8 tensor cores (else weight-only)
    act_quant: bool = False
    #: FP8 weight-only and int4 at a few rows: no tl.dot (BLOCK_M rows exactly, may be 1)
    gemv: bool = False
    #: FP8 at a few rows (either path): the weight tile is the MMA's first operand
    #: (:func:`.quant_tiles.quant_tile`'s ``SWAP``); BLOCK_N then wants 64 or more
    swap: bool = False
    #: one-row packed steps only: each step's scales and x are loaded a step before it
    #: (``AHEAD`` of :func:`.int4_fp16.int4_gemv_row` and
    #: :func:`.fp8_gemv.fp8_gemv_row`): no load left in the step, for about 30 registers more
    ahead: bool = False
    #: one-row packed steps only: the K loop unrolled this many times. The steps carry the
    #: next two steps' words in registers, and a loop body of one step copies them from
    #: role to role each step; three bodies a turn rotate the roles without copies (sm_90
    #: under Triton 3.6, int4 128 rows x 4 warps: 404 -> 377 instructions a step; FP8 64
    #: rows: 275 -> 233). Not with ``ahead``: its unrolled remainder loop waits on barriers
    unroll: int = 1
    #: one-row packed steps only: the weight words a thread loads from a row at once, 4 (16
    #: bytes) or 2 (more rows a thread, fewer of x's columns to convert: gemv_words.step_words)
    vec: int = 4
    #: one-row packed steps only: the weight words staged through shared memory by
    #: asynchronous copies, ``staged - 1`` K steps ahead (Triton pipelines a loop without
    #: ``tl.dot`` when the loop itself names its stages). 0: two steps ahead in registers,
    #: as ``unroll`` and ``ahead`` assume. Staged, no register holds a word while it travels
    #: (sm_90 under Triton 3.6, FP8 128 rows x 4 warps: 108 registers against 168)
    staged: int = 0
    #: which code runs the product: this module's kernel (``triton``), or cuBLAS after
    #: dequantizing the weight (``dense``, for prefill sizes) or on block-scaled FP8
    #: (``block_scaled``, any size): :mod:`.cublas_prefill`; the tile fields then unused.
    #: ``mma``: FP8 at one to eight rows on :mod:`.fp8_mma`, ``num_warps`` warps of
    #: ``BLOCK_N // (16 num_warps)`` tiles and ``SPLITS`` K parts
    route: str = "triton"

    def to_json(self) -> dict:
        return asdict(self)


def table_key(tag: str, n: int, k: int, dtype: torch.dtype) -> str:
    return f"{tag},N={n},K={k},{str(dtype).removeprefix('torch.')}"


@functools.lru_cache(maxsize=None)
def load_table(name: str) -> dict[str, dict[int, QuantGemmConfig]]:
    return {key: {int(m): QuantGemmConfig(**c) for m, c in per_m.items()}
            for key, per_m in read_table(CONFIG_DIR, name).items()}


@functools.lru_cache(maxsize=None)
def sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132


def k_parts_to_fill(tiles: int, k: int, sms: int, block_k: int = 128) -> int:
    """K parts that give ``tiles`` column tiles about two programs an SM (each part at least
    four K steps); one when the tiles alone fill the SMs."""
    return 1 if tiles >= sms else max(1, min(triton.cdiv(2 * sms, tiles), triton.cdiv(k, block_k) // 4))


def heuristic_config(fmt: int, rows: int, n: int, k: int, sms: int = 132) -> QuantGemmConfig:
    """Untuned shapes. Decode: 16-row tiles, 64 columns, and enough K parts for about two
    programs per SM (each part at least four K steps); int4 at one row the packed step on
    128 rows x 8 warps, unrolled (on an H100 within 2% of the tuned best for four of the
    27B's five projections and 18% for the fifth, where the 16-row tile took up to 1.9x as
    long). FP8 at one row the word step staged through shared memory, 64 rows x 4 warps, 4
    stages (on an H100, session 29: 3-9% faster than the 16-row tile at each of the 27B's
    five projections, and the tuned best at three). Prefill: 64 x 128 tiles (FP8 on its
    tensor cores); int4 and NVFP4 from :data:`DENSE_ROWS` rows dequantized for cuBLAS."""
    if rows == 1 and fmt == INT4:
        splits = k_parts_to_fill(triton.cdiv(n, 128), k, sms)
        return QuantGemmConfig(1, 128, 128, splits, GROUP_M=1, num_warps=8, num_stages=4, gemv=True, unroll=3)
    if rows == 1 and fmt == FP8:
        splits = k_parts_to_fill(triton.cdiv(n, 64), k, sms)
        return QuantGemmConfig(1, 64, 128, splits, GROUP_M=1, num_warps=4, num_stages=4, gemv=True, staged=4)
    if rows <= DECODE_ROWS:
        block_m = max(16, triton.next_power_of_2(rows))
        splits = k_parts_to_fill(triton.cdiv(rows, block_m) * triton.cdiv(n, 64), k, sms)
        return QuantGemmConfig(block_m, 64, 128, splits, GROUP_M=1, num_warps=4, num_stages=4)
    route = "dense" if fmt in (INT4, NVFP4) and rows >= DENSE_ROWS else "triton"
    return QuantGemmConfig(64, 128, 128, 1, GROUP_M=8, num_warps=4, num_stages=3, act_quant=fmt == FP8, route=route)


#: how far (a share of N) a tuned shape's N may be from a product's for its entries to serve
#: it when the table lacks the product's own shape
NEAR_N = 0.05


def table_entries(table: dict[str, dict[int, QuantGemmConfig]], tag: str, n: int, k: int,
                  dtype: torch.dtype) -> dict[int, QuantGemmConfig]:
    """The entries of this shape, or else of the tuned shape with the same format, K and
    dtype whose N is nearest, within :data:`NEAR_N`. A launch shape depends on N through the
    tile count alone, which a few percent hardly moves; and the fused shape a sweep tuned
    may differ from the one a checkpoint runs by a few rows (the 27B's in_proj: 16,480 rows
    tuned, 16,384 quantized beside 96 dense ones in every released checkpoint)."""
    exact = table.get(table_key(tag, n, k, dtype))
    if exact is not None:
        return exact
    prefix, suffix = f"{tag},N=", f",K={k},{str(dtype).removeprefix('torch.')}"
    near = [(abs(int(key[len(prefix):-len(suffix)]) - n), key) for key in table
            if key.startswith(prefix) and key.endswith(suffix) and key[len(prefix):-len(suffix)].isdigit()]
    near = [(gap, key) for gap, key in near if gap <= NEAR_N * n]
    return table[min(near)[1]] if near else {}


#: another card whose table serves instead of this one's (an A/B of its entries without
#: re-tuning: the H200's one-row entries predate the packed and staged steps the H100's
#: were tuned with); read once, as the other switches are
TABLE_FROM = os.environ.get("NINFER_QUANT_TABLE") or None


def table_name(device: torch.device) -> str:
    """The card whose table serves: :data:`TABLE_FROM`, else this one."""
    return TABLE_FROM or device_name(device)


@functools.lru_cache(maxsize=None)
def tuned_entries(name: str, tag: str, n: int, k: int, dtype: torch.dtype) -> dict[int, QuantGemmConfig]:
    """:func:`table_entries` of device table ``name``, resolved once a shape (prefill calls
    :func:`choose_config` for every product of every chunk)."""
    return table_entries(load_table(name), tag, n, k, dtype)


def choose_config(x: torch.Tensor, op) -> QuantGemmConfig:
    """The tuned entry (:func:`table_entries`) for the nearest row count at or above x's,
    or the heuristic when this device, shape or row count has none (a decode entry never
    serves a prefill)."""
    rows = x.shape[0]
    per_rows = tuned_entries(table_name(x.device), op.tag, op.n, op.k, x.dtype)
    decode = rows <= DECODE_ROWS
    at_or_above = [m for m in per_rows if m >= rows and (m <= DECODE_ROWS) == decode]
    if not at_or_above:
        return heuristic_config(op.fmt, rows, op.n, op.k, sm_count(x.device))
    return per_rows[min(at_or_above)]
