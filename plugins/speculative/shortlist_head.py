"""``--lm-head-draft``: draft logits over a shortlist of the vocabulary.

A draft token costs one pass of the LM head, and on Qwen3.6's 248k-token vocabulary
that head is most of a draft step's bytes. Drafts rarely need the rare tokens, so the
draft scores only the ``lm_head_draft_size`` most frequent ones (a copy of those rows of
the head) and maps the winner back to its vocabulary id. Verification always runs the
full head, so a token outside the shortlist is still produced whenever the target wants
it; it just cannot be drafted.

The shortlist is ``lm_head_shortlist.json`` beside the checkpoint (its format:
:mod:`ninfer.engine.spec.shortlist`): ``ninfer-train`` writes one for the models it
trains, and ``ninfer-shortlist MODEL_DIR`` counts one for any checkpoint over a corpus.
"""

from __future__ import annotations

import torch

class ShortlistHead:
    """``logits`` over the shortlist and ``pick`` mapping their argmax back to vocabulary ids."""

    def __init__(self, lm_head_weight: torch.Tensor, token_ids: list[int]):
        self.ids = torch.tensor(token_ids, dtype=torch.int64, device=lm_head_weight.device)
        self.weight = lm_head_weight.index_select(0, self.ids).contiguous()

    def argmax(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.ids[torch.nn.functional.linear(hidden, self.weight).argmax(dim=-1)]

    def logits(self, hidden: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """float32 [B, vocab_size]: the shortlist's logits in place, -inf elsewhere."""
        short = torch.nn.functional.linear(hidden, self.weight).float()
        full = short.new_full((hidden.shape[0], vocab_size), -torch.inf)
        return full.index_copy_(1, self.ids, short)
