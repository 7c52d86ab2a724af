"""Triton kernels for CUDA tensors, registered with :mod:`ninfer_kernels.ops` on import.

Importing this package without Triton installed registers nothing and raises nothing,
so CPU-only installs keep the plain-torch references.
"""

from __future__ import annotations

import importlib.util

if importlib.util.find_spec("triton") is not None:
    from ninfer_kernels import ops
    # Modules, not functions: ``paged_attention`` names both, and the module must stay reachable.
    from ninfer_kernels.triton import (
        activation, causal_conv, decode_attention, fused_moe, gated_delta, gated_delta_decode, gated_rms_norm,
        gdn_gates, kv_write, kv_quant, kv_quant_decode, moe_route, norm, norm_router, paged_attention, qk_norm_rope,
        quant_gemm, rope, skinny_linear, spec_rounds, state_rows,
    )

    ops.register_triton("linear", skinny_linear.linear)
    ops.register_triton("rms_norm", norm.rms_norm)
    ops.register_triton("rms_norm_router", norm_router.rms_norm_router)
    ops.register_triton("apply_rope", rope.apply_rope)
    ops.register_triton("silu_and_mul", activation.silu_and_mul)
    ops.register_triton("write_kv", kv_write.write_kv)
    ops.register_triton("paged_attention", paged_attention.paged_attention)
    ops.register_triton("qk_norm_rope", qk_norm_rope.qk_norm_rope)
    ops.register_triton("decode_attention", decode_attention.decode_attention)
    ops.register_triton("causal_conv1d", causal_conv.causal_conv1d)
    ops.register_triton("gated_delta_rule", gated_delta.gated_delta_rule)
    ops.register_triton("gdn_gates", gdn_gates.gdn_gates)
    ops.register_triton("gated_delta_decode", gated_delta_decode.gated_delta_decode)
    ops.register_triton("gated_delta_verify", gated_delta_decode.gated_delta_verify)
    ops.register_triton("gated_rms_norm", gated_rms_norm.gated_rms_norm)
    ops.register_triton("moe_route", moe_route.moe_route)
    ops.register_triton("fused_moe", fused_moe.fused_moe)
    ops.register_triton("copy_state_rows", state_rows.copy_rows)
    ops.register_triton("round_verdict", spec_rounds.round_verdict)
    ops.register_triton("round_advance", spec_rounds.round_advance)
    ops.register_triton("draft_chain_inputs", spec_rounds.draft_chain_inputs)
    ops.register_triton("write_kv_quant", kv_quant.write_kv_quant)
    ops.register_triton("paged_attention_quant", kv_quant.paged_attention_quant)
    ops.register_triton("decode_attention_quant", kv_quant_decode.decode_attention_quant)
    ops.register_triton("quant_linear", quant_gemm.quant_linear)
