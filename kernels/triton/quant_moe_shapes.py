"""Launch shapes of the quantized fused MoE (:mod:`.quant_moe`), chosen on the host from the
token count alone.

A tuned table per device in ``quant_moe_configs/<device name>.json`` (written by
scripts/gpu_quant_moe_tune.py: weight format and layer shape -> token count -> config),
else :func:`heuristic_config`: the bf16 heuristic's row blocks with each format's K step.

A single token's pairs run the one-row steps of :mod:`.fp8_gemv` and :mod:`.int4_fp16`,
one pair a program, and there the shape decides how many weight bytes are in flight: the
rows a program owns (``BLOCK_N``, hence the program count), its warps, and whether the
words travel through shared memory (``*_staged`` stages, as a quantized linear's
``staged``). FP8's gate and up rows may also stream in one loop (``joint``). Untuned, a
single token's gate_up takes 32-row programs: on the 35B-A3B 9 pairs x 512 / 32 = 144
programs for 132 SMs, with one 4 KiB step of gate or up rows in flight each.
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from ninfer_kernels.triton.moe_shapes import GemmConfig, token_bucket
from ninfer_kernels.triton.moe_shapes import heuristic_config as bf16_heuristic
from ninfer_kernels.triton.quant_tiles import FP8
from ninfer_kernels.triton.tuned_tables import device_name, read_table

CONFIG_DIR = Path(__file__).parent / "quant_moe_configs"


@dataclass(frozen=True)
class QuantMoeConfig:
    """``block_m`` (the runs' alignment), each GEMM's shape, and whether FP8 quantizes the
    activations (tensor-core path) or runs weight-only. For a single token's one-row steps:
    ``gate_up_staged`` / ``down_staged`` stage the weight words through shared memory
    (``stages - 1`` K steps ahead; 0 keeps two steps ahead in registers), and ``joint``
    (FP8, with ``gate_up_staged`` of 2 or more) streams gate and up rows in one loop."""

    block_m: int
    gate_up: GemmConfig
    down: GemmConfig
    act_quant: bool = False
    gate_up_staged: int = 0
    down_staged: int = 0
    joint: bool = False

    @classmethod
    def from_json(cls, entry: dict) -> QuantMoeConfig:
        fields = dict(entry)
        return cls(**{**fields, "gate_up": GemmConfig(**fields["gate_up"]), "down": GemmConfig(**fields["down"])})

    def to_json(self) -> dict:
        return asdict(self)


def heuristic_config(fmt: int, num_experts: int, top_k: int, num_tokens: int) -> QuantMoeConfig:
    """The bf16 heuristic's blocks with a 128-column K step (one scale group). One token
    takes 32-column gate_up tiles: k' pairs x I / 32 programs fill more SMs."""
    base = bf16_heuristic(num_experts, top_k, num_tokens)
    gate_up, down = replace(base.gate_up, BLOCK_K=128), replace(base.down, BLOCK_K=128)
    if num_tokens == 1:
        gate_up = replace(gate_up, BLOCK_N=32)
    return QuantMoeConfig(base.block_m, gate_up, down, act_quant=fmt == FP8 and base.block_m > 16)


def table_key(tag: str, num_experts: int, hidden: int, inter: int, top_k: int, dtype: torch.dtype) -> str:
    """``"fp8b128x128,E=257,H=2048,I=512,k=9,bfloat16"``: the experts' format tag, then the
    layer as :func:`.moe_shapes.shape_key` counts it (E and k with the shared expert, I one
    expert's intermediate width), then x's dtype."""
    return f"{tag},E={num_experts},H={hidden},I={inter},k={top_k},{str(dtype).removeprefix('torch.')}"


@functools.lru_cache(maxsize=None)
def load_table(name: str) -> dict[str, dict[int, QuantMoeConfig]]:
    return {key: {int(m): QuantMoeConfig.from_json(c) for m, c in per_m.items()}
            for key, per_m in read_table(CONFIG_DIR, name).items()}


#: token counts up to this are decode batches: a decode entry never serves a prefill, nor
#: the other way round
DECODE_TOKENS = 64
#: a tuned entry serves token counts down to this fraction of its own (below, the heuristic:
#: an 8,192-token tile set wastes most of its rows on 100 tokens)
SERVES_DOWN_TO = 0.25


def quant_moe_config(fmt: int, num_experts: int, top_k: int, num_tokens: int, tag: str = "", hidden: int = 0,
                     inter: int = 0, device: torch.device | None = None,
                     dtype: torch.dtype = torch.bfloat16) -> QuantMoeConfig:
    """The tuned entry of this device and layer (``tag``, ``hidden``, ``inter`` name it) for the
    nearest token count at or above ``num_tokens``, of the same kind (decode or prefill) and
    within :data:`SERVES_DOWN_TO` of it; past the largest tuned prefill count, that one's;
    else the heuristic for the count's :func:`~.moe_shapes.token_bucket` (the gaps between
    entries change config only at powers of two, which the warm-up compiles)."""
    per_m = load_table(device_name(device)).get(table_key(tag, num_experts, hidden, inter, top_k, dtype), {}) \
        if device is not None else {}
    decode = num_tokens <= DECODE_TOKENS
    same_kind = [m for m in per_m if (m <= DECODE_TOKENS) == decode]
    near = [m for m in same_kind if num_tokens <= m and num_tokens >= SERVES_DOWN_TO * m]
    if near:
        return per_m[min(near)]
    if not decode and same_kind and num_tokens > max(same_kind):
        return per_m[max(same_kind)]
    return heuristic_config(fmt, num_experts, top_k, token_bucket(num_tokens))
