"""What a speculative backend's proposer is given and what the engine asks of it.

A backend plugin (:class:`ninfer.capabilities.SpeculativeBackend`) declares the KV
caches its draft layers need (``attention_specs``), which the engine allocates in the
paged pool beside the target's (the same page ids, so prefix reuse, eviction and the
host tier move draft KV with the target's), then builds the proposer from a
:class:`ProposerContext`. Each step the engine asks :meth:`Proposer.propose` for the
drafts of every decode-ready row that may speculate, verifies them in that step's
forward pass, commits, and hands the proposer a :class:`StepRecord` of what the target
computed (a draft model extends its own KV and prepares the next round's drafts from it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Protocol

import torch


@dataclass(frozen=True)
class ProposerContext:
    model: Any  # the loaded target (ninfer.model.interface.CausalLM)
    profile: Any  # the resolved profile
    config: Any  # ninfer.engine.config.EngineConfig (draft_tokens, block_size, ...)
    #: the draft KV caches allocated for the backend's ``attention_specs``, in order
    caches: list = field(default_factory=list)
    device: torch.device = torch.device("cpu")
    vocab_size: int = 0
    #: the checkpoint directory (files beside the weights, such as an LM-head shortlist)
    model_dir: Optional[Path] = None
    #: whether the engine replays CUDA graphs (a draft model may capture its own then)
    cuda_graphs: bool = False


@dataclass(frozen=True)
class StepRecord:
    """One finished step, as a draft model needs it.

    For chunk ``i`` of ``chunks``: it started at position ``starts[i]`` (its sequence's
    computed tokens before the step), its rows in ``hidden`` (the target's final hidden
    states, flat) begin at ``row_starts[i]``, and ``kept[i]`` of its positions stand (all
    of a prefill chunk; a verify row's decode token and accepted drafts). The tokens that
    follow those positions are in the sequence's ``token_ids`` now.
    """

    chunks: list
    starts: list[int]
    row_starts: list[int]
    kept: list[int]
    hidden: Optional[torch.Tensor]
    #: after a device round (:mod:`ninfer.engine.spec.device_rounds`): per chunk, the drafts
    #: the proposer's ``draft_after_round`` computed on the device (its KV is extended too)
    next_drafts: Optional[list[list[int]]] = None


class Proposer(Protocol):
    def propose(self, seq: Any, limit: int) -> list[int]:
        """Up to ``limit`` draft tokens to follow ``seq``'s last token (may be fewer, or none)."""

    def after_step(self, record: StepRecord) -> None:
        """The target finished a step (a draft model extends its KV; others do nothing)."""

    @property
    def needs_hidden(self) -> bool:
        """Whether :meth:`after_step` reads the target's hidden states."""

    # Optional: ``draft_after_round(hidden, tokens, accepted, starts, tables, pages, host_lists)``
    # drafts greedily inside a device round from device tensors only (CUDA-graph safe); a
    # proposer that has it lets greedy rounds run on the device end to end and ahead of
    # their verdicts (see ninfer.engine.spec.device_rounds and MtpProposer for the contract).
