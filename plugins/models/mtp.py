"""The multi-token-prediction (MTP) head that hybrid Qwen checkpoints ship under ``mtp.*``.

It drafts the token after next: the main model's final hidden state at position ``t``
and the embedding of token ``t + 1`` are each RMS-normed (``pre_fc_norm_hidden``,
``pre_fc_norm_embedding``), concatenated as ``[embedding | hidden]`` and projected back to
the hidden size by ``fc``; then come full-attention decoder layer(s) of the main model's
kind and a final ``norm``, and the main model's embeddings and LM head serve as its own.
The engine does not run it yet: it is loaded and held as ``model.mtp`` for speculative
decoding backends to build on.
"""

from __future__ import annotations

from typing import Callable

from torch import nn

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
