"""A request's state inside the engine (plain data; no tensors)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

from ninfer.engine.context_cache import CacheHints


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # queued, holds no pages
    RUNNING = "running"  # admitted: holds its full page entitlement
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """Token ids (prompt, then generated) and how far the KV cache covers them.

    Tokens still to compute this step are ``token_ids[num_computed_tokens:]``; when
    exactly one remains the sequence is decode-ready, otherwise it is prefilling.

    Who writes what: the engine fills in the request's settings (every field before
    ``state_slot``) once, when it creates the sequence; from then on only the scheduler
    changes it (:mod:`ninfer.engine.scheduler`): ``status``, ``finish_reason``, the
    output tokens appended to ``token_ids`` and ``num_computed_tokens`` directly, the
    page fields and ``reuse_path`` through its block manager and ``state_slot`` through its
    state slots.
    The model runner and decode-ahead only read.
    """

    seq_id: int
    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    max_tokens: int  # effective output budget, already clamped to the context
    sampling: Any = None  # resolved sampling settings (ninfer.engine.defaults.ResolvedSampling)
    lookup_prefix_cache: bool = True
    commit_prefix_cache: bool = True  # publish full pages for reuse by later requests
    commit_generated: bool = True  # ...including pages that hold generated tokens
    lora_slot: int = 0  # LoRA adapter slot (ninfer.lora); 0: none
    lora_name: Optional[str] = None  # that adapter's name; keeps its KV pages apart from others'
    proposal: str = "auto"  # how a draft model proposes for it (spec_proposal_sampling)
    #: tokens reserved past the output budget for a speculative round's padding (the draft
    #: count, as far as the context reaches): a verify row near the end of its budget still
    #: holds its step's whole width, so the step stays on its captured graph, not eager
    spec_slack: int = 0
    #: the prompt's structure the context cache uses (turn closure, marked boundaries)
    cache_hints: CacheHints = CacheHints()
    state_slot: Optional[int] = None  # recurrent-state slot (hybrid families); None: the model keeps none
    #: which checkpoint the prefix hit came from (ninfer.engine.context_cache.PATHS), set at admission
    reuse_path: str = "root"
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    _pages: Any = field(default=None, repr=False)  # (block_table, the same as an array): see pages()
    _outputs: Any = field(default=None, repr=False)  # (int64 buffer, tokens in it): see output_array()
    _prompt: Any = field(default=None, repr=False)  # the prompt as an array: see prompt_array()
    finish_reason: Optional[str] = None
    arrival_time: float = field(default_factory=time.monotonic)
    admitted_time: Optional[float] = None
    first_token_time: Optional[float] = None

    def pages(self) -> np.ndarray:
        """``block_table`` as an int64 array, made once per table. Admission assigns a whole
        table and nothing edits one in place, so the steps' input staging copies this
        array instead of converting every page id from a Python int again each step (at
        8 sequences of 128k tokens that was a millisecond of host time a step)."""
        if self._pages is None or self._pages[0] is not self.block_table:
            self._pages = (self.block_table, np.asarray(self.block_table, dtype=np.int64))
        return self._pages[1]

    def output_array(self) -> np.ndarray:
        """The output token ids as an int64 array, extended by only the tokens appended
        since the last call (outputs only ever grow by appends). Penalties read a row's
        whole history every step; converting it from Python ints each time cost more
        host time a step than a 27B decode step takes once outputs reach tens of
        thousands of tokens at batch 8."""
        n = len(self.token_ids) - self.num_prompt_tokens
        buffer, held = self._outputs or (np.empty(0, dtype=np.int64), 0)
        if held > n:  # cannot happen today; start over rather than show stale tokens
            buffer, held = np.empty(0, dtype=np.int64), 0
        if n > held:
            if n > len(buffer):
                grown = np.empty(max(2 * len(buffer), n, 64), dtype=np.int64)
                grown[:held] = buffer[:held]
                buffer = grown
            start = self.num_prompt_tokens
            buffer[held:n] = self.token_ids[start + held : start + n]
        self._outputs = (buffer, n)
        return buffer[:n]

    def prompt_array(self) -> np.ndarray:
        """The prompt's token ids as an int64 array, made once (the prompt never changes)."""
        if self._prompt is None:
            self._prompt = np.asarray(self.token_ids[: self.num_prompt_tokens], dtype=np.int64)
        return self._prompt

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_pending_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_decode(self) -> bool:
        return self.num_pending_tokens == 1 and self.num_output_tokens > 0

    @property
    def entitlement_tokens(self) -> int:
        """Prompt plus the whole output budget (and any speculative slack): what admission
        must reserve pages for."""
        return self.num_prompt_tokens + self.max_tokens + self.spec_slack

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
