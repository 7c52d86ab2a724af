"""Quantized KV-cache formats shared by the cache and engine tests (``test_kv_quant.py``)
and the Triton kernel tests (``test_kv_quant_kernels.py``)."""

from __future__ import annotations

from ninfer_kernels import kv_quant as kq

FORMATS = ["int8", "fp8", "nvfp4", "k8v4"]
CODECS = {"int8": kq.INT8, "fp8": kq.FP8, "nvfp4": kq.nvfp4(0.5)}  # a global scale that is not 1
#: each format's key and value codecs
PAIRS = {"int8": ("int8", "int8"), "fp8": ("fp8", "fp8"), "nvfp4": ("nvfp4", "nvfp4"), "k8v4": ("fp8", "nvfp4")}
