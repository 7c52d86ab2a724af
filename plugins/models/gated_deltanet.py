"""Gated DeltaNet: the linear-attention layer of the hybrid Qwen families.

Per token: one projection gives queries and keys (``Hk`` heads of ``Dk``), values and
output gates ``z`` (``Hv`` heads of ``Dv``); another gives per-value-head ``b`` and ``a``.
Queries, keys and values pass a short causal depthwise conv (+ silu), then the gated
delta rule (:mod:`ninfer_kernels.gated_delta`) with write strength ``sigmoid(b)`` and
log-decay ``-exp(A_log) * softplus(a + dt_bias)``. The output is RMS-normed per value
head, gated by ``silu(z)`` and projected back.

Both projections are one matmul here, ``in_proj = [q | k | v | z | b | a]`` (a decode
step then launches one matmul, not two). Qwen3.5 checkpoints store the pieces as four
tensors (``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``); Qwen3-Next stores
``in_proj_qkvz`` and ``in_proj_ba``, each grouped per key head (``[q_i k_i v_i z_i]`` for
each key head ``i``), which :meth:`GatedDeltaNet.ungroup` reorders at load time.

Decode batches run everything after the projection in one op
(:func:`ninfer_kernels.ops.gated_delta_decode`); prefill chunks run the conv, the chunked
delta rule and the norm as separate ops, since there each is a large kernel.

Each layer owns its recurrent state for every slot: the conv history ``conv_state``
[slots, K-1, conv channels] in the model dtype (it holds projection outputs, which are
in that dtype anyway) and the delta-rule matrices ``ssm_state`` [slots, Hv, Dk, Dv] in
float32, because they accumulate over the whole sequence.
"""

from __future__ import annotations

import torch
from torch import nn

from ninfer.model.forward_batch import ForwardBatch
from ninfer_kernels import ops
from ninfer_plugins.models.hybrid_config import HybridConfig
from ninfer_plugins.models.hybrid_norms import GatedRMSNorm
from ninfer_plugins.models.layers import Linear, empty_param


class DepthwiseConvWeight(nn.Module):
    """Holds the conv kernel under the checkpoint's name (``conv1d.weight`` [C, 1, K])."""

    def __init__(self, channels: int, kernel: int):
        super().__init__()
        self.weight = empty_param(channels, 1, kernel)


class GatedDeltaNet(nn.Module):
    def __init__(self, cfg: HybridConfig):
        super().__init__()
        self.num_k_heads, self.head_k_dim = cfg.linear_num_key_heads, cfg.linear_key_head_dim
        self.num_v_heads, self.head_v_dim = cfg.linear_num_value_heads, cfg.linear_value_head_dim
        if self.num_v_heads % self.num_k_heads:
            raise ValueError(f"linear value heads ({self.num_v_heads}) must be a multiple of key heads ({self.num_k_heads})")
        self.key_dim = self.num_k_heads * self.head_k_dim
        self.value_dim = self.num_v_heads * self.head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.conv_kernel = cfg.linear_conv_kernel
        self.in_proj = Linear(cfg.hidden_size, self.conv_dim + self.value_dim + 2 * self.num_v_heads)
        self.conv1d = DepthwiseConvWeight(self.conv_dim, self.conv_kernel)
        self.A_log = empty_param(self.num_v_heads)
        self.dt_bias = empty_param(self.num_v_heads)
        self.norm = GatedRMSNorm(self.head_v_dim, cfg.rms_norm_eps)
        self.out_proj = Linear(self.value_dim, cfg.hidden_size)
        self.conv_state: torch.Tensor | None = None
        self.ssm_state: torch.Tensor | None = None

    # -- checkpoint layouts -------------------------------------------------------
    def fused_shards(self) -> dict[str, tuple[str, slice]]:
        """Checkpoint projections (Qwen3.5's four, Qwen3-Next's two) -> rows of ``in_proj``."""
        c, v, h = self.conv_dim, self.value_dim, self.num_v_heads
        return {
            "in_proj_qkv": ("in_proj", slice(0, c)),
            "in_proj_z": ("in_proj", slice(c, c + v)),
            "in_proj_b": ("in_proj", slice(c + v, c + v + h)),
            "in_proj_a": ("in_proj", slice(c + v + h, c + v + 2 * h)),
            "in_proj_qkvz": ("in_proj", slice(0, c + v)),
            "in_proj_ba": ("in_proj", slice(c + v, c + v + 2 * h)),
        }

    def ungroup(self, proj: str, weight: torch.Tensor) -> torch.Tensor:
        """Qwen3-Next's per-key-head grouped rows of ``proj`` (``in_proj_qkvz`` or ``in_proj_ba``)
        in our ``[q|k|v|z]`` / ``[b|a]`` order."""
        ratio = self.num_v_heads // self.num_k_heads
        if proj == "in_proj_qkvz":
            sizes = [self.head_k_dim, self.head_k_dim, ratio * self.head_v_dim, ratio * self.head_v_dim]
        else:
            sizes = [ratio, ratio]
        groups = weight.reshape(self.num_k_heads, sum(sizes), weight.shape[-1])
        return torch.cat([part.reshape(-1, weight.shape[-1]) for part in groups.split(sizes, dim=1)])

    # -- recurrent state ------------------------------------------------------------
    def state_bytes_per_slot(self) -> int:
        conv = (self.conv_kernel - 1) * self.conv_dim * self.conv1d.weight.dtype.itemsize
        return conv + self.num_v_heads * self.head_k_dim * self.head_v_dim * 4

    def allocate_state(self, num_slots: int, device: torch.device) -> int:
        dtype = self.conv1d.weight.dtype  # the model dtype (in_proj may be quantized)
        self.conv_state = torch.zeros(num_slots, self.conv_kernel - 1, self.conv_dim, dtype=dtype, device=device)
        self.ssm_state = torch.zeros(
            num_slots, self.num_v_heads, self.head_k_dim, self.head_v_dim, dtype=torch.float32, device=device
        )
        return self.conv_state.nbytes + self.ssm_state.nbytes

    def state_tensors(self) -> list[torch.Tensor]:
        assert self.conv_state is not None and self.ssm_state is not None, "allocate_state() must run first"
        return [self.conv_state, self.ssm_state]

    # -- forward ------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        assert self.ssm_state is not None, "allocate_state() must run before forward()"
        proj = self.in_proj(x)
        if batch.verify is not None:
            return self.out_proj(self._verify(proj, batch.verify))
        if batch.is_decode_only:
            return self.out_proj(self._decode(proj, batch))
        return self.out_proj(self._chunks(proj, batch))

    def _decode(self, proj: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        return ops.gated_delta_decode(
            proj, self.conv1d.weight[:, 0], self.conv_state, self.ssm_state, self.A_log, self.dt_bias,
            self.norm.weight, self.norm.eps, self.num_k_heads, self.head_k_dim, batch,
        )

    def _verify(self, proj: torch.Tensor, rows) -> torch.Tensor:
        """Speculative verify rows, each position's state to its own scratch row (see
        :class:`ninfer.model.forward_batch.VerifyRows`), then the rest of the batch."""
        n = rows.num_rows
        verified = ops.gated_delta_verify(
            proj[:n], self.conv1d.weight[:, 0], self.conv_state, self.ssm_state, self.A_log, self.dt_bias,
            self.norm.weight, self.norm.eps, self.num_k_heads, self.head_k_dim, rows.head, rows.position_rows,
        )
        if rows.rest is None and n == proj.shape[0]:  # verify rows only: no copy (a launch a layer)
            return verified
        out = proj.new_empty(proj.shape[0], self.value_dim)
        out[:n] = verified
        if rows.rest is not None:
            out[n:] = self._chunks(proj[n:], rows.rest)
        return out

    def _chunks(self, proj: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """Prefill chunks: conv, chunked delta rule and norm as separate (large) kernels."""
        tokens = proj.shape[0]
        qkv, z, b, a = proj.split([self.conv_dim, self.value_dim, self.num_v_heads, self.num_v_heads], dim=-1)
        # q, k and v come back as separate contiguous tensors: the chunked kernels want them so
        q, k, v = ops.causal_conv1d(qkv, self.conv1d.weight[:, 0], self.conv_state, batch,
                                    split=(self.key_dim, self.key_dim, self.value_dim))
        g, beta = ops.gdn_gates(a, b, self.A_log, self.dt_bias)
        out = ops.gated_delta_rule(
            q.reshape(tokens, self.num_k_heads, self.head_k_dim),
            k.reshape(tokens, self.num_k_heads, self.head_k_dim),
            v.reshape(tokens, self.num_v_heads, self.head_v_dim),
            g,
            beta,
            self.ssm_state,
            batch,
        )
        out = self.norm(out, z.unflatten(-1, (self.num_v_heads, self.head_v_dim)))  # z: a view, not a copy
        return out.reshape(tokens, self.value_dim)
