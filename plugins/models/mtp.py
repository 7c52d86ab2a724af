"""The multi-token-prediction (MTP) head that hybrid Qwen checkpoints ship under ``mtp.*``.

It drafts the token after next: the main model's final hidden state at position ``t``
and the embedding of token ``t + 1`` are each RMS-normed (``pre_fc_norm_hidden``,
``pre_fc_norm_embedding``), concatenated as ``[embedding | hidden]`` and projected back to
the hidden size by ``fc``; then come full-attention decoder layer(s) of the main model's
kind and a final ``norm``, and the main model's embeddings and LM head serve as its own.
It is loaded and held as ``model.mtp``; the ``mtp`` speculative backend
(:mod:`ninfer_plugins.speculative.mtp`) runs it. Its attention layers get their own
paged KV caches from that backend.

Positions: the row pairing hidden state ``t`` with token ``t + 1`` runs at position
``t`` (its RoPE angle and its KV slot), as in vLLM's and SGLang's MTP drafting; a chained
step feeds the head's own normed output as the next hidden state, one position on.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from ninfer.model.forward_batch import ForwardBatch

from ninfer_plugins.models.hybrid_config import HybridConfig
from ninfer_plugins.models.hybrid_norms import ZeroCentredRMSNorm
from ninfer_plugins.models.layers import Linear


class MtpHead(nn.Module):
    def __init__(self, cfg: HybridConfig, make_layer: Callable[[], nn.Module]):
        super().__init__()
        h = cfg.hidden_size
        self.fc = Linear(2 * h, h)
        self.pre_fc_norm_embedding = ZeroCentredRMSNorm(h, cfg.rms_norm_eps)
        self.pre_fc_norm_hidden = ZeroCentredRMSNorm(h, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(make_layer() for _ in range(cfg.mtp_num_layers))
        self.norm = ZeroCentredRMSNorm(h, cfg.rms_norm_eps)

    def forward(self, embeddings: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch,
                cos_sin: torch.Tensor) -> torch.Tensor:
        """``embeddings`` of the next tokens and the ``hidden`` states before them [T, H] ->
        the head's normed output [T, H] (the LM head turns it into draft logits)."""
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(embeddings), self.pre_fc_norm_hidden(hidden)], dim=-1))
        residual = None
        for layer in self.layers:
            x, residual = layer(positions, x, residual, batch, cos_sin)
        x, _ = self.norm(x, residual)
        return x

    def attention_layers(self) -> list:
        return [layer.self_attn for layer in self.layers]
