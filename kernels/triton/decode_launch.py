"""Tuned launch shapes for decode attention (one new token per sequence) per KV format.

At batch 1 a decode attention layer is a handful of KV heads over a long context: the
grid is (sequence, KV head, key split) and only the split count fills the GPU. How many
splits, how wide a key tile and how deep the load pipeline keep every SM's memory
requests in flight depends on the stored format (bf16 tiles versus one-byte codes with
scales), so both decode kernels (:mod:`.decode_attention` for the plain cache,
:mod:`.kv_quant` for the quantized ones) ask here first and fall back to their own
heuristics when the device has no table.

The table, ``decode_attention_configs/<device>.json``, is written by
``scripts/gpu_kv_decode_sweep.py`` from timings at long contexts (32k and 128k keys):
``"<format>,D=<head dim>" -> batch -> {splits, block_n, num_warps, num_stages}``. A batch
between two entries takes the smaller one's shape with its splits divided by the ratio
(the same number of programs), and no launch uses splits of fewer than ``min_keys``
keys of the longest context the caller expects. Below :data:`MIN_CONTEXT` (the longest
context, which under CUDA graphs is the engine's max context) the kernels' own
heuristics stay: the tables say nothing about short contexts. A quantized format the
sweep has not measured takes fp8's shapes when its keys are one-byte codes too.
"""

from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from ninfer_kernels.triton.tuned_tables import device_name, read_table

CONFIG_DIR = Path(__file__).parent / "decode_attention_configs"
#: the tables are measured at long contexts: a launch sized for a shorter longest context
#: (a CUDA graph is captured for the engine's max context) keeps the kernel's own heuristic
MIN_CONTEXT = 16384
#: formats whose keys are one-byte codes may borrow fp8's shapes; nvfp4 keys may not (fp8's
#: 64-key, 2-stage tile asked for 288 KiB of shared memory with them on the H200)
ONE_BYTE_KEYS = ("fp8", "int8")


@dataclass(frozen=True)
class DecodeLaunch:
    splits: int
    block_n: int
    num_warps: int
    num_stages: int

    def to_json(self) -> dict:
        return asdict(self)


def format_key(kv_format: str, head_dim: int) -> str:
    """The table key: ``kv_format`` is the plain cache's dtype name (``bfloat16``) or the
    quantized codecs' (``fp8``; ``fp8/nvfp4`` when keys and values differ)."""
    return f"{kv_format},D={head_dim}"


@functools.lru_cache(maxsize=None)
def load_table(name: str) -> dict[str, dict[int, DecodeLaunch]]:
    return {key: {int(b): DecodeLaunch(**c) for b, c in per_batch.items()}
            for key, per_batch in read_table(CONFIG_DIR, name).items()}


def tuned_launch(kv_format: str, head_dim: int, num_seqs: int, max_seq_len: int, min_keys: int,
                 device: torch.device) -> DecodeLaunch | None:
    """The table's shape for this batch, or None when the device or format has none."""
    if device.type != "cuda" or max_seq_len < MIN_CONTEXT:
        return None
    table = load_table(device_name(device))
    per_batch = table.get(format_key(kv_format, head_dim))
    if per_batch is None and kv_format.split("/")[0] in ONE_BYTE_KEYS:  # the quantized kernel's shapes
        per_batch = table.get(format_key("fp8", head_dim))
    return scaled_launch(per_batch or {}, num_seqs, max_seq_len, min_keys)


def scaled_launch(per_batch: dict[int, DecodeLaunch], num_seqs: int, max_seq_len: int,
                  min_keys: int) -> DecodeLaunch | None:
    """The entry for the largest batch at or below ``num_seqs``, its splits scaled to keep
    the program count, capped by ``min_keys`` and rounded down to a power of two."""
    at_or_below = [b for b in per_batch if b <= num_seqs]
    if not at_or_below:
        return None
    batch = max(at_or_below)
    entry = per_batch[batch]
    splits = min(max(1, entry.splits * batch // num_seqs), max(1, math.ceil(max_seq_len / min_keys)))
    return replace(entry, splits=1 << (splits.bit_length() - 1))
