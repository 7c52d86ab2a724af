"""What the dense and hybrid decoders share: the pre-norm block and the model around the stack.

A block normalises its input, mixes tokens (attention, or linear attention in hybrid
layers), normalises again and runs its MLP. The residual stream is carried between
blocks rather than added inside them, so each norm fuses the previous add.
:class:`PreNormLM` owns the LM head (optionally tied to the input embedding), the RoPE
table and the forward pass over ``self.model`` (``embed_tokens``, ``layers``, ``norm``).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from ninfer.model.forward_batch import ForwardBatch
from ninfer.model.interface import CausalLM
from ninfer_kernels.rope import rope_cos_sin
from ninfer_plugins.models.layers import Linear


class PreNormBlock(nn.Module):
    """Subclasses set ``input_layernorm``, ``post_attention_layernorm`` and ``mlp`` (the
    checkpoint's names) and implement :meth:`mix`."""

    input_layernorm: nn.Module
    post_attention_layernorm: nn.Module
    mlp: nn.Module

    def mix(self, positions: torch.Tensor, x: torch.Tensor, batch: ForwardBatch, cos_sin: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        residual: Optional[torch.Tensor],
        batch: ForwardBatch,
        cos_sin: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.mix(positions, x, batch, cos_sin)
        # an MLP that can fuse its first launch into the norm before it takes the norm too
        from_residual = getattr(self.mlp, "from_residual", None)
        if from_residual is not None:
            return from_residual(self.post_attention_layernorm, x, residual)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class PreNormLM(CausalLM):
    """A stack of :class:`PreNormBlock` under ``self.model``, its LM head and RoPE table."""

    model: nn.Module

    def _add_head(self, cfg: Any, rotary_dim: int) -> None:
        """The LM head (tied when ``cfg.tie_word_embeddings``) and the cos/sin table; call
        after ``self.model`` exists."""
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size)
        self.lm_head.quantizable = False  # speculative drafting and shortlists read its rows
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        cos_sin = rope_cos_sin(
            cfg.max_positions, rotary_dim, cfg.rope_theta, torch.get_default_dtype(),
            self.model.embed_tokens.weight.device, cfg.rope_scaling,
        )
        self.register_buffer("cos_sin", cos_sin, persistent=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        residual = None
        for layer in self.model.layers:
            x, residual = layer(positions, x, residual, batch, self.cos_sin)
        x, _ = self.model.norm(x, residual)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
