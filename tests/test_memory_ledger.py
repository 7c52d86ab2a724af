"""The startup ledger says where device memory went, including hybrid families' state pool."""

from __future__ import annotations

import re

from loguru import logger

from ninfer import LLM


def _ledger(model: str, **overrides) -> str:
    lines: list[str] = []
    sink = logger.add(lambda m: lines.append(str(m)), level="INFO")
    try:
        LLM(model, **overrides)
    finally:
        logger.remove(sink)
    return next(line for line in lines if "memory: weights" in line)


def test_ledger_counts_kv_pages_and_state_slots():
    dense = _ledger("tiny:qwen3", kv_capacity=1024)
    assert re.search(r"as bf16 \(1024 tokens in pages of 16; \d+ bytes a token, [\d,]+ tokens per GiB\), "
                     r"recurrent state 0\.0 MiB \(0 slots\)", dense)
    fp8 = _ledger("tiny:qwen3", kv_capacity=1024, kv_dtype="fp8", dtype="bf16")
    per_token = int(re.search(r"; (\d+) bytes a token", fp8).group(1))
    native = int(re.search(r"; (\d+) bytes a token", _ledger("tiny:qwen3", kv_capacity=1024, dtype="bf16")).group(1))
    assert per_token < native  # real bytes: values and scales, not the model dtype's
    hybrid = _ledger("tiny:qwen3_5", max_concurrency=3, kv_capacity=1024)
    assert "(3 slots)" in hybrid and "recurrent state 0.0 MiB (0 slots)" not in hybrid
