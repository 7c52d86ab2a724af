"""Launch shapes of the fused MoE kernels, chosen on the host from the token count alone.

A tuned table per device in ``moe_configs/<device name>.json`` (written by
scripts/gpu_moe_tune.py, and scripts/gpu_skinny_sweep.py for the one-token kernels'
``one_token`` entries), else a heuristic by pairs per expert.
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from ninfer_kernels.triton.moe_single_token import SingleTokenConfig
from ninfer_kernels.triton.tuned_tables import device_name, read_table

CONFIG_DIR = Path(__file__).parent / "moe_configs"
DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


@dataclass(frozen=True)
class GemmConfig:
    """Launch shape of one grouped GEMM (BLOCK_M is the call's, shared by both)."""

    BLOCK_N: int
    BLOCK_K: int
    GROUP_M: int = 1
    num_warps: int = 4
    num_stages: int = 3

    def clipped(self, max_n: int, max_k: int) -> GemmConfig:
        return replace(self, BLOCK_N=min(self.BLOCK_N, max_n), BLOCK_K=min(self.BLOCK_K, max_k))


@dataclass(frozen=True)
class MoeConfig:
    """One call's shapes: ``block_m`` (the alignment of the runs) and each GEMM's; for one
    token, optionally the single-token kernels' (their defaults when absent)."""

    block_m: int
    gate_up: GemmConfig
    down: GemmConfig
    one_token: SingleTokenConfig | None = None

    @classmethod
    def from_json(cls, entry: dict) -> MoeConfig:
        one = entry.get("one_token")
        return cls(int(entry["block_m"]), GemmConfig(**entry["gate_up"]), GemmConfig(**entry["down"]),
                   SingleTokenConfig(**one) if one else None)

    def to_json(self) -> dict:
        out = {"block_m": self.block_m, "gate_up": asdict(self.gate_up), "down": asdict(self.down)}
        if self.one_token is not None:
            out["one_token"] = asdict(self.one_token)
        return out


def shape_key(num_experts: int, hidden: int, inter: int, top_k: int, dtype: torch.dtype) -> str:
    """The tables' key for a layer: ``"E=257,H=2048,I=512,k=9,bf16"``. E and k count the
    shared expert when there is one (E = routed experts + 1, k = top_k + 1: the ids'
    columns), I is one expert's intermediate width (w13 holds 2I rows)."""
    return f"E={num_experts},H={hidden},I={inter},k={top_k},{DTYPE_NAMES.get(dtype, str(dtype))}"


@functools.lru_cache(maxsize=None)
def load_table(name: str) -> dict[str, dict[int, MoeConfig]]:
    """``moe_configs/<name>.json`` as {shape key: {M: config}}; empty when there is none.
    Read once per device name (keys starting with "_" are comments)."""
    return {key: {int(m): MoeConfig.from_json(c) for m, c in per_m.items()}
            for key, per_m in read_table(CONFIG_DIR, name).items()}


def heuristic_config(num_experts: int, top_k: int, num_tokens: int) -> MoeConfig:
    """Without a tuned entry: decode-sized calls (a few rows per expert) are bound by
    reading the weights, so short blocks and long K tiles; prefill-sized ones by math."""
    per_expert = num_tokens * top_k / max(num_experts, 1)
    if per_expert <= 16:
        small = GemmConfig(BLOCK_N=64, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=3)
        return MoeConfig(16, small, small)
    if per_expert <= 48:
        mid = GemmConfig(BLOCK_N=64, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=3)
        return MoeConfig(32, mid, mid)
    return MoeConfig(64, GemmConfig(BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3),
                     GemmConfig(BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=4))


def token_bucket(num_tokens: int) -> int:
    """The power of two at or above ``num_tokens``. Untuned calls take the heuristic's
    config for their bucket, so configs change only at powers of two, where the engine's
    warm-up (prompts a token short of each power and at it) compiles them all."""
    return 1 << max(num_tokens - 1, 0).bit_length()


def select_config(device: torch.device, num_experts: int, hidden: int, inter: int, top_k: int,
                  dtype: torch.dtype, num_tokens: int) -> MoeConfig:
    """The tuned entry with the nearest M at or above ``num_tokens`` (else the largest M),
    or the heuristic for its :func:`token_bucket` when this device or shape has no table.
    Host-side, from T alone."""
    table = load_table(device_name(device)).get(shape_key(num_experts, hidden, inter, top_k, dtype))
    if not table:
        return heuristic_config(num_experts, top_k, token_bucket(num_tokens))
    at_or_above = [m for m in table if m >= num_tokens]
    return table[min(at_or_above) if at_or_above else max(table)]
