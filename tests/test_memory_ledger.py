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


def test_auto_kv_capacity_leaves_room_for_the_second_scratch_bank(monkeypatch):
    """Rounds on the device that run ahead of their snapshots take a second bank of
    verify rows (about 150 MiB a row on the 27B shape): ``kv_capacity: auto`` must count it
    before sizing the KV pool, or the state pool allocated after it runs out of memory."""
    from types import SimpleNamespace

    import torch

    from ninfer.engine import builder
    from ninfer_plugins.speculative.mtp import MTP

    gib, row = 1 << 30, 150 << 20
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (40 * gib, 80 * gib))
    model = SimpleNamespace(attention_specs=lambda: [], state_bytes_per_slot=lambda: row)
    kv_format = SimpleNamespace(bytes_per_token=lambda dtype, heads, dim: 0)
    monkeypatch.setattr(builder, "kv_bytes_per_token", lambda fmt, specs, dtype: 1 << 20)
    profile = SimpleNamespace(
        engine=SimpleNamespace(kv_capacity="auto", max_concurrency=8, max_context=4096, decode_ahead=True,
                               prefix_reuse=True, prefill_chunk=1024),
        speculative=SimpleNamespace(backend="mtp", draft_tokens=3), cache=SimpleNamespace(device_state_slots=8))

    def tokens() -> int:
        return builder.kv_capacity_tokens(profile, kv_format, model, torch.bfloat16, torch.device("cuda"), (), MTP)

    banked = tokens()
    monkeypatch.setenv("NINFER_DEVICE_ROUNDS", "0")
    one_bank = tokens()
    assert one_bank - banked == 8 * 4 * row // (1 << 20)  # a second bank of 8 slots x 4 rows, in 1 MiB tokens
    profile.engine.prefix_reuse = False  # no snapshots: one bank whatever the rounds
    monkeypatch.delenv("NINFER_DEVICE_ROUNDS")
    assert tokens() == one_bank

    # a step's activations: 1 GiB up to 4,096 tokens a step, then 256 KiB a token more
    profile.engine.prefill_chunk = 4096 - 8 * 4
    assert tokens() == one_bank
    profile.engine.prefill_chunk = 8192 - 8 * 4
    assert one_bank - tokens() == gib // (1 << 20)
