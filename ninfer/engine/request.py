"""Protocol-neutral request and event types between the front doors and the engine."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from ninfer.engine.context_cache import CacheHints
from ninfer.engine.exposure import RequestExposure
from ninfer.engine.thinking_budget import ThinkingBudget
from ninfer.errors import NinferError
from ninfer.outputs import PositionLogprobs
from ninfer.sampling_params import SamplingParams


@dataclass
class EngineRequest:
    """One generation: prompt token ids plus how to sample and stop.

    ``thinking`` selects the family's thinking or non-thinking sampler presets
    (None: the process default). ``max_tokens`` of None in ``params`` means "the
    process default, clamped to the context"; an explicit value that cannot fit is an
    error.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    prompt: Optional[str] = None
    thinking: Optional[bool] = None
    lookup_prefix_cache: bool = True
    commit_prefix_cache: bool = True
    commit_generated: bool = True
    thinking_budget: Optional[ThinkingBudget] = None
    lora_name: Optional[str] = None  # a loaded LoRA adapter to run with; None: the base model
    #: which of one request's ``n`` samples this is: offsets its seed (ninfer.engine.defaults)
    sample_index: int = 0
    #: False: decode without speculation even when the engine has a speculative backend
    speculate: bool = True
    #: how a draft model proposes for this request: "auto" (greedy for greedy requests, a
    #: draw from its own distribution for sampled ones), "greedy" or "probabilistic"
    proposal: str = "auto"
    #: the prompt's turn closure and marked boundaries, for the context cache
    cache_hints: CacheHints = field(default_factory=CacheHints)


@dataclass
class RequestTimings:
    """Monotonic timestamps (seconds) of a request's milestones, and the engine's counters of it.

    The engine updates one object per request and every event of the request refers to
    it; read the counters once the final event has arrived (the engine is done with it then).
    """

    arrival: float
    admitted: Optional[float] = None
    first_token: Optional[float] = None
    last_token: Optional[float] = None
    #: speculative decoding: tokens drafted for this request, and how many of them were kept
    draft_tokens: int = 0
    draft_accepted: int = 0
    #: verify rounds that carried drafts, and per draft position (0 = first) how many kept it
    draft_rounds: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    #: the engine steps this request sat through (see ninfer.engine.exposure)
    exposure: RequestExposure = field(default_factory=RequestExposure)
    #: the sampler settings the engine resolved (a ninfer.engine.defaults.ResolvedSampling)
    sampling: Optional[object] = None
    #: thinking budget: reasoning tokens the engine counted against it, and whether it forced the close
    thinking_counted: Optional[int] = None
    thinking_forced: bool = False
    #: which checkpoint the prefix hit came from (ninfer.engine.context_cache.PATHS), once admitted
    reuse_path: Optional[str] = None

    def record_round(self, drafted: int, accepted: int) -> None:
        """One verify round of this request: ``drafted`` proposals, the first ``accepted`` kept."""
        self.draft_tokens += drafted
        self.draft_accepted += accepted
        if not drafted:  # padded into another row's verify step: no round of its own
            return
        self.draft_rounds += 1
        grow = drafted - len(self.accepted_per_position)  # positions reached show, kept or not
        if grow > 0:
            self.accepted_per_position += [0] * grow
        for i in range(accepted):
            self.accepted_per_position[i] += 1


@dataclass
class GenerationEvent:
    """What one engine step produced for one request.

    ``token_ids`` are the output tokens committed in this step (they count even when
    their text is still held back by UTF-8 or stop-string buffering); ``text`` is the
    newly releasable text. The last event of a request has ``finished`` set.

    Progress events carry no tokens: one when the request is admitted (its prefix-cache
    hit is then final) and one after each prefill chunk; ``prompt_processed`` says how
    many prompt tokens the KV cache holds (cached plus computed).
    """

    request_id: str
    token_ids: list[int]
    text: str
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int
    timings: RequestTimings
    prompt_processed: int = 0
    logprobs: Optional[list[PositionLogprobs]] = None
    finished: bool = False
    finish_reason: Optional[str] = None  # "stop" | "length" | "abort" | "error"
    stop_reason: Optional[object] = None  # matched stop string or stop token id
    error: Optional[NinferError] = None
    #: the prompt's log probabilities (None for position 0), once: on the first token's
    #: event, or the final one when nothing is generated; only when the request asked
    prompt_logprobs: Optional[list[Optional[PositionLogprobs]]] = None
