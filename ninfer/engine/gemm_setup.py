"""cuBLAS settings the engine picks before its first matmul on CUDA.

Decode matmuls are skinny: one row per running sequence. Given a workspace, cuBLAS runs
the narrow ones (Qwen3-8B's o_proj and down_proj) split along their inner dimension
and adds a reduction kernel. Without a workspace it picks single-kernel versions that
the H200 runs faster (8B shapes at batch 1: o_proj 10.8 -> 9.0 us, down_proj 29.1 ->
26.5 us; about 0.15 ms per decode step; see docs/performance.md). The matmuls stay
plain torch calls into cuBLAS.

torch reads the setting once, when it first hands cuBLAS a workspace, so it must be
in place before anything in the process multiplies on the GPU. A value the user set
is left alone.
"""

from __future__ import annotations

import os

import torch
from loguru import logger

#: torch's cuBLAS workspace variable: ":KiB:count" blocks; none at all here
NO_WORKSPACE = ":0:0"


def prefer_matmuls_without_workspace(device: torch.device) -> None:
    """Run cuBLAS without a workspace on ``device`` unless the user chose otherwise."""
    if device.type != "cuda":
        return
    chosen = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    if chosen is not None:
        logger.info("cuBLAS workspace as set in CUBLAS_WORKSPACE_CONFIG ({})", chosen)
        return
    os.environ["CUBLAS_WORKSPACE_CONFIG"] = NO_WORKSPACE
    os.environ.setdefault("CUBLASLT_WORKSPACE_SIZE", "0")
    logger.info("cuBLAS runs without a workspace (no split-K reductions in decode matmuls); "
                "set CUBLAS_WORKSPACE_CONFIG to choose otherwise")
