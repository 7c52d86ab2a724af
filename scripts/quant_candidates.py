"""The launch shapes the quantized GEMM sweep (``gpu_quant_gemm_sweep.py --parts tune``)
times for each format and row count: decode tiles, the one-row steps (value by value,
packed, staged through shared memory), FP8 on the tensor cores from registers, and at
prefill sizes our tiles against the cuBLAS routes; and the quantized experts' shapes at
one token and at prefill sizes (``gpu_quant_moe_tune.py``). The tables keep whichever
measured fastest, so a candidate costs only tuning time."""

from __future__ import annotations

import itertools
from dataclasses import replace

import torch
import triton

from ninfer_kernels.triton import cublas_prefill as cp
from ninfer_kernels.triton import fp8_mma
from ninfer_kernels.triton import quant_gemm as qg
from ninfer_kernels.triton.moe_shapes import GemmConfig
from ninfer_kernels.triton import quant_moe_shapes as qms
from ninfer_kernels.triton.quant_tiles import FP8


def decode_candidates(fmt: str, rows: int, n: int, k: int, sms: int,
                      fp8_tensor_cores: bool = False, block_scaled: bool = False) -> list[qg.QuantGemmConfig]:
    """``fp8_tensor_cores``: FP8 only on the tensor-core path (x quantized), as prefill always
    is, so a row count never changes how an FP8 checkpoint rounds. ``block_scaled``: this
    card and torch run :data:`BLOCK_SCALED` for the shape."""
    block_m = max(16, triton.next_power_of_2(rows))
    found = [qg.heuristic_config(FP8 if fmt == "fp8" else -1, rows, n, k, sms)]
    # FP8 also on the tensor cores, x quantized inside the GEMM (no weight conversion)
    for act in (False, True) if fmt == "fp8" else (False,):
        for block_n, warps, stages in ((32, 4, 4), (64, 4, 3), (64, 8, 4), (128, 4, 3), (128, 8, 4)):
            tiles = triton.cdiv(rows, block_m) * triton.cdiv(n, block_n)
            fill = qg.k_parts_to_fill(tiles, k, sms)
            for splits in sorted({fill, 2 * fill} if fill > 1 or tiles < 2 * sms else {1}):
                found.append(qg.QuantGemmConfig(block_m, block_n, 128, splits, 1, warps, stages, act_quant=act))
    if fmt == "fp8" and rows <= 16:  # the weight tile as the MMA's wide first operand
        for block_n, warps, stages in ((64, 4, 4), (64, 4, 6), (128, 4, 4), (128, 8, 4), (128, 4, 6)):
            tiles = triton.cdiv(n, block_n)
            fill = qg.k_parts_to_fill(tiles, k, sms)
            for splits in sorted({fill, 2 * fill}):
                found.append(qg.QuantGemmConfig(block_m, block_n, 128, splits, 1, warps, stages, act_quant=True,
                                                swap=True))
        # weight-only too: the converted tile feeds Hopper's warpgroup MMA from registers
        # (sm_90 code: HGMMA.64x16x16 with a register operand), where unswapped it runs the
        # older 16-row MMA (session 22; on the H100 in session 23 it won no 27B shape at one row)
        for block_n, warps, stages in ((64, 4, 3), (64, 4, 4), (128, 4, 3), (128, 8, 3), (128, 8, 4)):
            tiles = triton.cdiv(n, block_n)
            fill = qg.k_parts_to_fill(tiles, k, sms)
            for splits in sorted({fill, 2 * fill}):
                found.append(qg.QuantGemmConfig(block_m, block_n, 128, splits, 1, warps, stages, swap=True))
    if fmt != "nvfp4" and rows <= 4:
        found += gemv_candidates(rows, n, k, sms)
    if fmt != "nvfp4" and rows == 1:
        found += staged_candidates(fmt, n, k, sms)
    if fmt == "fp8" and block_scaled:  # cuBLAS's block-scaled FP8 product, x quantized as on our tensor-core path
        found.append(BLOCK_SCALED)
    if fmt == "fp8" and rows <= fp8_mma.MMA_ROWS:
        found += mma_candidates(n, k, sms)
    if fmt == "fp8" and fp8_tensor_cores:
        found = [c for c in found if c.act_quant]
    return list(dict.fromkeys(found))


def mma_candidates(n: int, k: int, sms: int) -> list[qg.QuantGemmConfig]:
    """FP8 on the tensor cores from registers (kernels/triton/fp8_mma.py): 4 warps of one or
    two 16-row tiles (session 28 on the H100: best or within 1% everywhere), K parts around
    the one wave ``fp8_splits`` aims at."""
    found = []
    for tiles in (1, 2):
        fill = fp8_mma.fp8_splits(n, k, 4, sms, tiles)
        for splits in sorted({max(1, fill // 2), fill, 2 * fill}):
            found.append(qg.QuantGemmConfig(16, 64 * tiles, 128, splits, 1, 4, 1, route="mma"))
    return found


def gemv_candidates(rows: int, n: int, k: int, sms: int) -> list[qg.QuantGemmConfig]:
    """The no-tl.dot kernel's shapes: exactly ``rows`` rows, K parts to fill the SMs. At one
    row the packed steps (kernels/triton/int4_fp16.py, fp8_gemv.py) share x's conversion
    among the rows a thread holds: wider tiles too, and each with its loads a step ahead
    (``ahead``), without, and with its loop unrolled three times (``unroll``), that also
    with 8-byte loads (``vec``)."""
    found = []
    shapes = ((32, 4), (16, 4), (64, 8)) + (((128, 8), (256, 8), (128, 4), (256, 4)) if rows == 1 else ())
    for block_n, warps in shapes:
        tiles = triton.cdiv(n, block_n)
        fill = qg.k_parts_to_fill(tiles, k, sms)
        for ahead, unroll, vec in ((False, 1, 4), (True, 1, 4), (False, 3, 4), (False, 3, 2)) if rows == 1 else (
                (False, 1, 4),):
            found.append(qg.QuantGemmConfig(triton.next_power_of_2(rows), block_n, 128, fill, 1, warps, 4, gemv=True,
                                            ahead=ahead, unroll=unroll, vec=vec))
    return found


def staged_candidates(fmt: str, n: int, k: int, sms: int) -> list[qg.QuantGemmConfig]:
    """The one-row packed steps with their words staged through shared memory (a config's
    ``staged``), K parts to fill the SMs and more (fewer registers leave room for more
    programs an SM). FP8 also on narrow tiles with deeper stages: on the H100 (session 29)
    32 rows x 4 warps at 5 stages first won three of the 27B's five shapes, the narrowest
    tile then offered; with these, 64 x 4 at 4 stages won the same three. int4 at one row
    runs on the tensor cores unless ``NINFER_INT4_MMA=0``: its entries are for that
    comparison."""
    found = staged_shapes(((32, 4), (64, 8), (128, 4), (128, 8), (256, 8)), (3, 5), 2, n, k, sms)
    if fmt == "fp8":
        found += staged_shapes(((16, 4), (32, 4), (64, 4)), (4, 6, 8), 4, n, k, sms)
    return found


def staged_shapes(tiles_warps, stages, most_parts: int, n: int, k: int, sms: int) -> list[qg.QuantGemmConfig]:
    """Each (rows, warps) at each stage count, with 1, 2 .. ``most_parts`` times the K
    parts that fill the SMs (each part at least four K steps)."""
    found = []
    for block_n, warps in tiles_warps:
        fill = qg.k_parts_to_fill(triton.cdiv(n, block_n), k, sms)
        parts = sorted({min(fill * m, max(1, k // 512)) for m in (1, 2, 4) if m <= most_parts})
        for staged in stages:
            for splits in parts:
                found.append(qg.QuantGemmConfig(1, block_n, 128, splits, 1, warps, 4, gemv=True, staged=staged))
    return found


PREFILL_FP8 = [qg.QuantGemmConfig(64, 128, 128, 1, 8, 4, 3, True), qg.QuantGemmConfig(128, 128, 128, 1, 8, 8, 3, True),
               qg.QuantGemmConfig(128, 128, 128, 1, 8, 4, 4, True), qg.QuantGemmConfig(128, 256, 128, 1, 8, 8, 3, True),
               qg.QuantGemmConfig(64, 256, 128, 1, 8, 4, 4, True)]
PREFILL_WEIGHT_ONLY = [qg.QuantGemmConfig(64, 128, 128, 1, 8, 4, 3), qg.QuantGemmConfig(128, 128, 128, 1, 8, 8, 3)]
#: cuBLAS after dequantizing the weight (every format), and FP8 on block-scaled cuBLAS
DENSE = qg.QuantGemmConfig(64, 128, 128, route="dense")
BLOCK_SCALED = qg.QuantGemmConfig(64, 128, 128, act_quant=True, route="block_scaled")


def prefill_candidates(fmt: str, x: torch.Tensor, w) -> list[qg.QuantGemmConfig]:
    """Our tiles and the cuBLAS routes (:mod:`ninfer_kernels.triton.cublas_prefill`); the
    block-scaled one only where this torch and card run it (else it would time our tiles)."""
    if fmt != "fp8":
        return [*PREFILL_WEIGHT_ONLY, DENSE]
    return [*PREFILL_FP8, DENSE] + ([BLOCK_SCALED] if cp.block_scaled_available(x, w) else [])


#: one-token expert programs, (rows a program, warps): each warp reads 4-word (16-byte) runs
#: of 4 rows at a 128-column step, so a program wants about 4 rows a warp or more (int4's
#: gate_up reads twice its rows: gate and up together)
MOE_ROWS_WARPS = ((4, 1), (8, 1), (8, 2), (16, 2), (16, 4), (32, 4), (64, 4))


def moe_one_token_candidates(fmt: str, part: str, base: qms.QuantMoeConfig) -> list[qms.QuantMoeConfig]:
    """A single token's quantized experts (``gpu_quant_moe_tune.py``): ``part`` "gate_up" or
    "down" varied on ``base``, each program shape with the words two steps ahead in
    registers or staged through shared memory (3, 5 or 8 stages); FP8's gate_up also with
    gate and up rows in one staged loop. ``base`` comes first."""
    found = [base]
    rows_warps = MOE_ROWS_WARPS + (((128, 4),) if part == "down" else ())
    for (rows, warps), staged in itertools.product(rows_warps, (0, 3, 5, 8)):
        gemm = replace(getattr(base, part), BLOCK_N=rows, num_warps=warps)
        config = replace(base, **{part: gemm, f"{part}_staged": staged, "joint": False})
        found.append(config)
        if fmt == "fp8" and part == "gate_up" and staged:
            found.append(replace(config, joint=True))
    return list(dict.fromkeys(found))


def moe_grouped_candidates(fmt: str, part: str, base: qms.QuantMoeConfig) -> list[qms.QuantMoeConfig]:
    """Many tokens' quantized experts (prefill): the grouped GEMM's tiles for ``part``, one
    scale group a K step; the runs' alignment (``block_m``, both GEMMs') varies with the
    gate_up, which is tuned first. FP8 multiplies on its tensor cores (x quantized)."""
    found = [base]
    block_ms = sorted({base.block_m, 64, 128}) if part == "gate_up" else (base.block_m,)
    for block_m, block_n, warps, stages in itertools.product(block_ms, (64, 128), (4, 8), (3, 4)):
        gemm = GemmConfig(BLOCK_N=block_n, BLOCK_K=128, GROUP_M=8, num_warps=warps, num_stages=stages)
        found.append(replace(base, block_m=block_m, **{part: gemm}))
    return list(dict.fromkeys(found))
