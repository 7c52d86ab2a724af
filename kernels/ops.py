"""The single place models take kernels from: ``from ninfer_kernels import ops``.

Each op has a plain-torch reference and, once written, a Triton implementation for
CUDA tensors. The choice is made per call from the first tensor's device type.
``NINFER_KERNELS=reference`` (read at import) forces the references everywhere,
which is how a suspected kernel bug is ruled in or out. ``NINFER_KERNELS=triton`` does the
opposite on a machine without a GPU: with ``TRITON_INTERPRET=1`` every op that has a Triton
version runs it on CPU tensors, so a whole engine runs its CUDA path's kernels (slowly; that
is how session 32 checked the speculative rounds' drafts through the Triton kernels).
"""

from __future__ import annotations

import os
from typing import Callable, Sequence

import torch

from ninfer.model.forward_batch import ForwardBatch
from ninfer_kernels import (
    activation, attention, causal_conv, decode_attention, gated_delta, gated_delta_decode, gated_rms_norm, moe, norm,
    kv_quant, qk_norm_rope, quant_formats, rope, spec_rounds, state_rows,
)

FORCE_REFERENCE = os.environ.get("NINFER_KERNELS", "").strip().lower() == "reference"
FORCE_TRITON = os.environ.get("NINFER_KERNELS", "").strip().lower() == "triton"

#: op name -> {"reference": fn, "triton": fn or None}
IMPLEMENTATIONS: dict[str, dict[str, Callable | None]] = {
    "linear": {"reference": torch.nn.functional.linear, "triton": None},
    "rms_norm": {"reference": norm.rms_norm, "triton": None},
    "rms_norm_router": {"reference": norm.rms_norm_router, "triton": None},
    "apply_rope": {"reference": rope.apply_rope, "triton": None},
    "silu_and_mul": {"reference": activation.silu_and_mul, "triton": None},
    "write_kv": {"reference": attention.write_kv, "triton": None},
    "paged_attention": {"reference": attention.paged_attention, "triton": None},
    "qk_norm_rope": {"reference": qk_norm_rope.qk_norm_rope, "triton": None},
    "decode_attention": {"reference": decode_attention.decode_attention, "triton": None},
    "causal_conv1d": {"reference": causal_conv.causal_conv1d, "triton": None},
    "gated_delta_rule": {"reference": gated_delta.gated_delta_rule, "triton": None},
    "gdn_gates": {"reference": gated_delta.gdn_gates, "triton": None},
    "gated_delta_decode": {"reference": gated_delta_decode.gated_delta_decode, "triton": None},
    "gated_delta_verify": {"reference": gated_delta_decode.gated_delta_verify, "triton": None},
    "gated_rms_norm": {"reference": gated_rms_norm.gated_rms_norm, "triton": None},
    "moe_route": {"reference": moe.moe_route, "triton": None},
    "fused_moe": {"reference": moe.fused_moe, "triton": None},
    "copy_state_rows": {"reference": state_rows.copy_rows, "triton": None},
    "round_verdict": {"reference": spec_rounds.round_verdict, "triton": None},
    "round_advance": {"reference": spec_rounds.round_advance, "triton": None},
    "draft_chain_inputs": {"reference": spec_rounds.draft_chain_inputs, "triton": None},
    "write_kv_quant": {"reference": kv_quant.write_kv_quant, "triton": None},
    "paged_attention_quant": {"reference": kv_quant.paged_attention_quant, "triton": None},
    "decode_attention_quant": {"reference": kv_quant.decode_attention_quant, "triton": None},
    "quant_linear": {"reference": quant_formats.quant_linear, "triton": None},
}


def register_triton(op: str, fn: Callable) -> None:
    """Install the CUDA implementation of ``op``; it must accept the reference's arguments."""
    if op not in IMPLEMENTATIONS:
        raise KeyError(f"unknown kernel op {op!r} (known: {', '.join(IMPLEMENTATIONS)})")
    IMPLEMENTATIONS[op]["triton"] = fn


def has_triton(op: str) -> bool:
    """Whether ``op`` has a CUDA kernel installed (and the references are not forced)."""
    return IMPLEMENTATIONS[op]["triton"] is not None and not FORCE_REFERENCE


def choose(op: str, device_type: str) -> Callable:
    """The implementation of ``op`` for tensors on ``device_type`` ("cpu", "cuda", ...)."""
    impls = IMPLEMENTATIONS[op]
    triton_fn = impls["triton"]
    if triton_fn is not None and not FORCE_REFERENCE and (device_type == "cuda" or FORCE_TRITON):
        return triton_fn
    return impls["reference"]


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear``; on CUDA a few-row product may take a Triton kernel (see skinny_linear)."""
    return choose("linear", x.device.type)(x, weight, bias)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
    expert_rows: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm (:func:`ninfer_kernels.norm.rms_norm`), with the residual add before it and,
    with ``expert_rows``, the sum of a mixture-of-experts layer's rows before that."""
    impl = choose("rms_norm", x.device.type)
    # the flag only when set: implementations from before it (benchmark A/Bs) still plug in
    return impl(x, weight, eps, residual, expert_rows=True) if expert_rows else impl(x, weight, eps, residual)


def apply_rope(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, rotary_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    return choose("apply_rope", q.device.type)(q, k, positions, cos_sin, rotary_dim)


def qk_norm_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    rotary_dim: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    return choose("qk_norm_rope", q.device.type)(q, k, q_weight, k_weight, eps, positions, cos_sin, rotary_dim)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    return choose("silu_and_mul", x.device.type)(x)


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    choose("write_kv", k.device.type)(k_cache, v_cache, k, v, slot_mapping)


def paged_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: ForwardBatch, scale: float,
    gate: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention over the paged cache; with ``gate``, times ``sigmoid(gate)`` (in the kernel on CUDA)."""
    return choose("paged_attention", q.device.type)(q, k_cache, v_cache, batch, scale, gate=gate)


def decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    rotary_dim: int,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: ForwardBatch,
    scale: float,
    gate: torch.Tensor | None = None,
) -> torch.Tensor:
    return choose("decode_attention", q.device.type)(
        q, k, v, q_weight, k_weight, eps, positions, cos_sin, rotary_dim, k_cache, v_cache, batch, scale, gate
    )


def causal_conv1d(
    x: torch.Tensor, weight: torch.Tensor, states: torch.Tensor, batch: ForwardBatch, split: Sequence[int] | None = None
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    return choose("causal_conv1d", x.device.type)(x, weight, states, batch, split)


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    states: torch.Tensor,
    batch: ForwardBatch,
) -> torch.Tensor:
    return choose("gated_delta_rule", q.device.type)(q, k, v, g, beta, states, batch)


def gdn_gates(a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor,
              dt_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Gated DeltaNet's per-token ``(g, beta)`` (:func:`ninfer_kernels.gated_delta.gdn_gates`)."""
    return choose("gdn_gates", a.device.type)(a, b, a_log, dt_bias)


def gated_delta_decode(
    proj: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_states: torch.Tensor,
    ssm_states: torch.Tensor,
    a_log: torch.Tensor,
    dt_bias: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    num_k_heads: int,
    head_k_dim: int,
    batch: ForwardBatch,
) -> torch.Tensor:
    return choose("gated_delta_decode", proj.device.type)(
        proj, conv_weight, conv_states, ssm_states, a_log, dt_bias, norm_weight, eps, num_k_heads, head_k_dim, batch
    )


def gated_delta_verify(
    proj: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_states: torch.Tensor,
    ssm_states: torch.Tensor,
    a_log: torch.Tensor,
    dt_bias: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    num_k_heads: int,
    head_k_dim: int,
    batch: ForwardBatch,
    position_rows: torch.Tensor,
) -> torch.Tensor:
    return choose("gated_delta_verify", proj.device.type)(
        proj, conv_weight, conv_states, ssm_states, a_log, dt_bias, norm_weight, eps, num_k_heads, head_k_dim, batch,
        position_rows,
    )


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return choose("gated_rms_norm", x.device.type)(x, gate, weight, eps)


def moe_route(
    logits: torch.Tensor,
    top_k: int,
    renormalize: bool,
    x: torch.Tensor | None = None,
    shared_gate: torch.Tensor | None = None,
    gate_in_logits: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    impl = choose("moe_route", logits.device.type)
    if gate_in_logits:
        return impl(logits, top_k, renormalize, x, shared_gate, gate_in_logits=True)
    return impl(logits, top_k, renormalize, x, shared_gate)


def rms_norm_router(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    router: torch.Tensor,
    shared_gate: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A MoE block's residual add, input norm and router matmul
    (:func:`ninfer_kernels.norm.rms_norm_router`): one launch for decode batches on CUDA."""
    return choose("rms_norm_router", x.device.type)(x, residual, weight, eps, router, shared_gate)


def route_tokens(
    x: torch.Tensor,
    router: torch.Tensor,
    top_k: int,
    renormalize: bool,
    shared_gate: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A MoE router: its linear layer ``x @ router.T`` (``router`` [E, H], the product in x's
    dtype, as :func:`linear` runs it) and then :func:`moe_route` on those logits. Two
    launches on CUDA; one launch for both measured slower twice (docs/moe.md)."""
    return moe_route(linear(x, router), top_k, renormalize, x, shared_gate)


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    shared13: torch.Tensor | None = None,
    shared2: torch.Tensor | None = None,
    summed: bool = True,
) -> torch.Tensor:
    """The routed experts' MLPs (:func:`ninfer_kernels.moe.fused_moe`). ``w13`` / ``w2`` are
    stacked tensors, or quantized weights of :mod:`ninfer_kernels.quant_formats` with a
    leading expert dimension; every implementation takes both. ``summed`` false: each
    token's weighted rows [T, k', H], for :func:`rms_norm`'s ``expert_rows``."""
    impl = choose("fused_moe", x.device.type)
    if summed:  # as above: older implementations take no flag
        return impl(x, w13, w2, weights, ids, shared13, shared2)
    return impl(x, w13, w2, weights, ids, shared13, shared2, summed=False)


def write_kv_quant(k_parts: Sequence[torch.Tensor], v_parts: Sequence[torch.Tensor], k_codec, v_codec,
                   k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Quantize and store new K/V in a quantized cache's parts (see :mod:`ninfer_kernels.kv_quant`)."""
    choose("write_kv_quant", k.device.type)(k_parts, v_parts, k_codec, v_codec, k, v, slot_mapping)


def decode_attention_quant(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, norm_rope,
                           k_parts: Sequence[torch.Tensor], v_parts: Sequence[torch.Tensor], k_codec, v_codec,
                           batch: ForwardBatch, scale: float, gate: torch.Tensor | None = None) -> torch.Tensor:
    """A decode batch over a quantized cache: q/k norm, RoPE, the new K/V's quantized write and
    attention (one launch on CUDA), times ``sigmoid(gate)`` when given."""
    return choose("decode_attention_quant", q.device.type)(q, k, v, norm_rope, k_parts, v_parts, k_codec, v_codec,
                                                           batch, scale, gate)


def paged_attention_quant(q: torch.Tensor, k_parts: Sequence[torch.Tensor], v_parts: Sequence[torch.Tensor],
                          k_codec, v_codec, batch: ForwardBatch, scale: float) -> torch.Tensor:
    """Paged attention over a quantized cache, dequantizing as it reads."""
    return choose("paged_attention_quant", q.device.type)(q, k_parts, v_parts, k_codec, v_codec, batch, scale)


def quant_linear(x: torch.Tensor, weight: "quant_formats.QuantWeight", bias: torch.Tensor | None = None
                 ) -> torch.Tensor:
    """``y = x W^T (+ b)`` for a weight in one of :mod:`ninfer_kernels.quant_formats`' layouts."""
    return choose("quant_linear", x.device.type)(x, weight, bias)


def copy_state_rows(pools: list[torch.Tensor], src: torch.Tensor, dst: torch.Tensor) -> None:
    """In every state pool, row ``dst[i]`` takes row ``src[i]`` (see :mod:`ninfer_kernels.state_rows`)."""
    if pools:
        choose("copy_state_rows", pools[0].device.type)(pools, src, dst)


def round_verdict(ids: torch.Tensor, num_drafts: torch.Tensor, target: torch.Tensor,
                  position_rows: torch.Tensor | None):
    """A greedy device round's verdict (see :mod:`ninfer_kernels.spec_rounds`)."""
    return choose("round_verdict", ids.device.type)(ids, num_drafts, target, position_rows)


def round_advance(tokens: torch.Tensor, accepted: torch.Tensor, drafts: torch.Tensor, input_ids: torch.Tensor,
                  positions: torch.Tensor, slot_mapping: torch.Tensor, seq_lens: torch.Tensor,
                  num_drafts: torch.Tensor, pages: torch.Tensor, block_tables: torch.Tensor, block_size: int,
                  position_rows: torch.Tensor | None = None, bank_first: int = 0, bank_rows: int = 0) -> torch.Tensor:
    """A greedy device round's next inputs, written in place (see :mod:`ninfer_kernels.spec_rounds`)."""
    return choose("round_advance", tokens.device.type)(
        tokens, accepted, drafts, input_ids, positions, slot_mapping, seq_lens, num_drafts, pages, block_tables,
        block_size, position_rows, bank_first, bank_rows)


def draft_chain_inputs(tokens: torch.Tensor, accepted: torch.Tensor, starts: torch.Tensor,
                       block_tables: torch.Tensor, pages: torch.Tensor, block_size: int, k: int):
    """A chained drafter's inputs after a device round's verdict (see :mod:`ninfer_kernels.spec_rounds`)."""
    return choose("draft_chain_inputs", tokens.device.type)(tokens, accepted, starts, block_tables, pages,
                                                            block_size, k)


try:
    import triton  # noqa: F401
except ImportError:  # CPU-only install: the references serve every device
    pass
else:
    import ninfer_kernels.triton  # noqa: E402,F401  (registers the CUDA kernels)
