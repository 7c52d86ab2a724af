"""The synchronous engine core: requests in, one step at a time, events out.

Not thread-safe: exactly one thread (the caller of :class:`ninfer.LLM`, or the
background thread of :class:`ninfer.engine.async_engine.AsyncEngine`) drives it.
"""

from __future__ import annotations

import itertools
import time
from typing import Optional

import torch
from loguru import logger

from ninfer.engine.block_manager import BlockManager
from ninfer.engine.commit import TokenCommits, Tracked
from ninfer.engine.config import EngineConfig
from ninfer.engine.decode_ahead import plan_ahead
from ninfer.engine.defaults import resolve_sampling
from ninfer.engine.exposure import RequestExposure, StepPhases
from ninfer.engine.guided_masks import GuidedMasks
from ninfer.engine.guided_state import GuidedState
from ninfer.engine.model_runner import ModelRunner
from ninfer.engine.output_processor import RequestOutputState
from ninfer.engine.parts import EngineParts, prefix_reuse_on
from ninfer.engine.pending_step import InFlight, SampledRow
from ninfer.engine.request import EngineRequest, GenerationEvent
from ninfer.engine.sampling_metadata import to_device
from ninfer.engine.scheduler import Scheduler, SchedulerOutput
from ninfer.engine.spec.device_rounds import plan_round_ahead
from ninfer.engine.spec.distribution import PROPOSAL_POLICIES
from ninfer.engine.spec.rounds import SpeculativeRounds
from ninfer.engine.sequence import Sequence
from ninfer.engine.stats import EngineStats
from ninfer.errors import ContextLengthExceededError, InvalidRequestError, UnsupportedFeatureError
from ninfer.lora import LoraRegistry

#: consecutive failed model steps after which the engine declares itself dead
MAX_FAILED_STEPS = 3


class _BatchFailed(Exception):
    """Launching or finishing the step of ``sched`` failed (the cause is chained)."""

    def __init__(self, sched: SchedulerOutput):
        super().__init__()
        self.sched = sched


class LLMEngine(SpeculativeRounds, TokenCommits):
    """Requests in, one step at a time, events out.

    Assembled whole by its constructor from :class:`~ninfer.engine.parts.EngineParts`
    built beforehand (:func:`ninfer.engine.builder.build_engine`): the KV pool and the
    host tier go to the block manager, the recurrent state to the scheduler (and its
    snapshots to the block manager as the frontier index), the decode graphs and the
    guided masks to the model runner. The scheduler alone changes a sequence's state;
    the engine tells it what a step computed and which tokens it committed.
    """

    def __init__(self, model, tokenizer, config: EngineConfig, parts: EngineParts, presets, device, vocab_size: int):
        self.model, self.tokenizer, self.config = model, tokenizer, config
        self.presets, self.device, self.vocab_size = presets, device, vocab_size
        self.num_blocks = parts.kv.num_blocks
        self.kv_bytes = parts.kv.nbytes
        state = parts.state
        self.block_manager = BlockManager(
            self.num_blocks, config.block_size, enable_prefix_reuse=prefix_reuse_on(config, state),
            host_kv=parts.host_kv, frontier_index=state.snapshots if state is not None else None,
            limits=config.descriptor_limits, costs=parts.costs,
        )
        self.scheduler = Scheduler(self.block_manager, config.max_concurrency, config.prefill_chunk, state=state,
                                   draft_tokens=config.draft_tokens)
        self.loras = LoraRegistry(model)  # empty until LLM.load_lora / the batch runner adds adapters
        #: guided decoding (None: off); the runner masks the guided rows it samples
        self.guided = parts.guided
        self.guided_masks = (
            GuidedMasks(self.guided.compiler, vocab_size, device, config.max_concurrency)
            if self.guided is not None else None
        )
        self.runner = ModelRunner(model, config.block_size, device, vocab_size, self.loras,
                                  guided=self.guided_masks, graphs=parts.graphs,
                                  scratch=state.scratch if state is not None else None,
                                  keep_hidden=parts.proposer is not None and parts.proposer.needs_hidden,
                                  verify_graphs=parts.verify_graphs, rounds=parts.rounds)
        #: the speculative proposer (None: plain decoding); its rounds are verified in the step
        self.proposer = parts.proposer
        self.stats = EngineStats()
        self.eos_token_ids = list(tokenizer.eos_token_ids)
        self._requests: dict[str, Tracked] = {}
        self._seq_ids = itertools.count()
        self._prompt_logprobs: dict[int, int] = {}  # seq id -> top-N, while its prompt is being scored
        self._failed_steps = 0
        self.dead: Optional[str] = None
        self._decode_ahead = parts.decode_ahead
        self._in_flight: Optional[InFlight] = None  # a step launched ahead, not yet processed
        self._last_step_done = 0.0

    @property
    def decode_ahead(self) -> bool:
        """Whether the next decode step may be launched before this one's tokens reach the
        host (:mod:`ninfer.engine.decode_ahead`)."""
        return self._decode_ahead

    def set_decode_ahead(self, enabled: bool) -> None:
        """Turn steps launched ahead on or off while idle: ``ninfer-bench --decode-ahead
        both`` measures one loaded engine both ways. Serving fixes it at construction."""
        if self.has_unfinished():
            raise RuntimeError("decode-ahead can only be switched while no request runs")
        self._decode_ahead = enabled

    @property
    def kv_capacity_tokens(self) -> int:
        """The KV pool in tokens: one request's prompt plus output must fit it."""
        return self.num_blocks * self.config.block_size

    def reset_stats(self) -> None:
        """Start the step counters from zero (after the warm-up's throwaway requests)."""
        self.stats = EngineStats()

    # -- requests --------------------------------------------------------------
    def add_request(self, req: EngineRequest) -> None:
        """Validate and queue; raises a typed :class:`NinferError` for bad input."""
        if req.request_id in self._requests:
            raise InvalidRequestError(f"duplicate request id {req.request_id!r}", param="request_id")
        params = req.params
        params.validate(self.vocab_size)
        if req.proposal not in PROPOSAL_POLICIES:
            raise InvalidRequestError(f"proposal must be one of {', '.join(PROPOSAL_POLICIES)}", param="proposal")
        n_prompt = len(req.prompt_token_ids)
        if n_prompt == 0:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        if any(not 0 <= t < self.vocab_size for t in req.prompt_token_ids):
            raise InvalidRequestError("prompt token ids must lie inside the vocabulary", param="prompt")
        max_tokens = self._output_budget(n_prompt, params.max_tokens)
        thinking = self.config.thinking if req.thinking is None else req.thinking
        lora_slot = self.lora_slot(req.lora_name)
        guided = self._guided_state(req, thinking)
        seq = Sequence(
            seq_id=next(self._seq_ids),
            request_id=req.request_id,
            token_ids=list(req.prompt_token_ids),
            num_prompt_tokens=n_prompt,
            max_tokens=max_tokens,
            sampling=resolve_sampling(params, self.presets, thinking, self.config.process_sampling, self.eos_token_ids,
                                      req.sample_index),
            # scoring the prompt needs every position computed, so cached pages cannot stand in
            lookup_prefix_cache=req.lookup_prefix_cache and params.prompt_logprobs is None,
            commit_prefix_cache=req.commit_prefix_cache,
            commit_generated=req.commit_generated,
            lora_slot=lora_slot,
            lora_name=req.lora_name,
            proposal=req.proposal,
            cache_hints=req.cache_hints,
        )
        if self.proposer is not None and req.speculate:
            # padding never reaches past the context (the position tables end there)
            seq.spec_slack = max(0, min(self.config.draft_tokens, self.config.max_context - seq.entitlement_tokens))
            if not self.scheduler.fits_ever(seq):  # the slack never costs a request its admission
                seq.spec_slack = 0
        if not self.scheduler.fits_ever(seq):
            raise ContextLengthExceededError(
                f"prompt plus output ({seq.entitlement_tokens} tokens) exceeds the KV capacity "
                f"({self.kv_capacity_tokens} tokens)",
                param="max_tokens",
            )
        out = RequestOutputState(self.tokenizer, params, self.eos_token_ids, max_tokens)
        self._requests[req.request_id] = Tracked(req, seq, out, guided)
        self.scheduler.add(seq)
        if guided is not None:
            self.guided_masks.track(seq.seq_id, guided)
        if params.prompt_logprobs is not None:
            self._prompt_logprobs[seq.seq_id] = params.prompt_logprobs

    def _guided_state(self, req: EngineRequest, thinking: bool) -> Optional[GuidedState]:
        """Compile the request's guide (raising before anything is queued)."""
        spec = req.params.guided
        if spec is None:
            return None
        if self.guided is None:
            raise UnsupportedFeatureError(
                "guided decoding is turned off on this server (guided.backend: none, or no backend installed)",
                param=spec.param,
            )
        return self.guided.start(spec, req.prompt_token_ids, thinking)

    def lora_slot(self, name: Optional[str]) -> int:
        """The slot of a loaded adapter (0 for None); an unknown name is the client's error."""
        try:
            return self.loras.slot(name)
        except KeyError:
            loaded = ", ".join(map(repr, self.loras.names())) or "none"
            raise InvalidRequestError(
                f"unknown LoRA adapter {name!r} (loaded: {loaded})", param="lora_name"
            ) from None

    def _output_budget(self, n_prompt: int, requested: Optional[int]) -> int:
        """The request's limit, else the default shortened to what the context and the KV pool leave.

        ``Pipeline.plan`` refuses these cases first, naming the client's fields; this guards
        callers that hand the engine requests of their own.
        """
        room = self.config.max_context - n_prompt
        if requested is None:
            # the default is the server's choice, so it gives way to the pool too (vLLM stops at
            # the context the same way); only a request's own limit is a demand
            kv_room = self.kv_capacity_tokens - n_prompt
            if min(room, kv_room) < 1:
                raise ContextLengthExceededError(
                    f"the prompt has {n_prompt} tokens; the context holds {self.config.max_context} "
                    f"and the KV capacity {self.kv_capacity_tokens}", param="messages"
                )
            return min(self.config.default_max_tokens, room, kv_room)
        if requested > room:
            raise ContextLengthExceededError(
                f"prompt ({n_prompt} tokens) plus max_tokens ({requested}) exceeds the context "
                f"of {self.config.max_context} tokens",
                param="max_tokens",
            )
        return requested

    def abort_request(self, request_id: str) -> Optional[GenerationEvent]:
        tracked = self._requests.get(request_id)
        if tracked is None:
            return None
        self.scheduler.abort(tracked.seq)
        return self._final_event(tracked, tracked.out.finish("abort"), [])

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    # -- stepping --------------------------------------------------------------
    def step(self) -> list[GenerationEvent]:
        """Run one model step and return its events: launch it (unless it was launched
        ahead), queue the next decode step behind it where that cannot depend on this
        step's tokens, then wait for this step's tokens and commit them."""
        events: list[GenerationEvent] = []
        began = time.perf_counter()
        try:
            current = self._take_launched_ahead() or self._schedule_and_launch(events)
            if current is None:
                return events  # nothing to run
            following = self._launch_ahead(current)
            launched = time.perf_counter()
            rows, prompt_rows = self._wait(current)
        except _BatchFailed as failed:  # the whole batch failed (and what was queued behind it)
            return events + self._fail_batch(failed.sched, failed.__cause__)
        ready = time.perf_counter()
        charged = self._exposures(current.sched)  # before the commit: finishing forgets a request
        events += self._commit_step(current, rows, prompt_rows)
        self._in_flight = following
        # charged after the commit, before the events leave this thread: a final event's
        # reader sees the whole step
        phases = StepPhases(launched - began, ready - launched, time.perf_counter() - ready,
                            prefill=current.sched.num_decode < len(current.sched.chunks))
        self.stats.record_phases(phases)
        for exposure, decode_row in charged:
            exposure.charge(phases, decode_row)
        return events

    def _exposures(self, sched: SchedulerOutput) -> list[tuple[RequestExposure, bool]]:
        """The live requests of a step, each with whether its row decodes."""
        out = []
        for i, chunk in enumerate(sched.chunks):
            tracked = None if chunk.seq.is_finished else self._requests.get(chunk.seq.request_id)
            if tracked is not None:
                out.append((tracked.timings.exposure, i < sched.num_decode))
        return out

    def _take_launched_ahead(self) -> Optional[InFlight]:
        """The step launched ahead last time, unless all its requests have ended since."""
        current, self._in_flight = self._in_flight, None
        if current is not None and all(c.seq.is_finished for c in current.sched.chunks):
            return None
        return current

    def _schedule_and_launch(self, events: list[GenerationEvent]) -> Optional[InFlight]:
        """Schedule a step and launch it; its admissions are reported into ``events`` (the
        prefix-cache hit is final then). None when there is nothing to run."""
        sched = self.scheduler.schedule(self._drafts())
        if sched.is_empty:
            return None
        now = time.monotonic()
        for seq in sched.admitted:
            tracked = self._requests[seq.request_id]
            tracked.timings.admitted = now
            tracked.timings.reuse_path = seq.reuse_path
            events.append(self._event(tracked, "", []))
        try:
            q = self._draft_probs(sched)
            return InFlight(sched, self.runner.launch(sched, self._prompt_logprobs, draft_probs=q), time.perf_counter())
        except Exception as exc:
            raise _BatchFailed(sched) from exc

    @staticmethod
    def _wait(current: InFlight) -> tuple[list[SampledRow], dict[int, list[SampledRow]]]:
        """Block until ``current``'s sampled tokens are on the host."""
        try:
            return current.pending.result()
        except Exception as exc:
            raise _BatchFailed(current.sched) from exc

    def _commit_step(
        self, current: InFlight, rows: list[SampledRow], prompt_rows: dict[int, list[SampledRow]]
    ) -> list[GenerationEvent]:
        """Count the finished step, then commit its results."""
        self._failed_steps = 0
        done = time.perf_counter()
        self.stats.record_step(current.sched, done - max(current.launched, self._last_step_done))
        self._last_step_done = done
        sched = current.sched
        starts = [c.seq.num_computed_tokens for c in sched.chunks]
        pending = current.pending
        events = self._process(sched, rows, prompt_rows, pending.round_bank if pending.is_device_round else None)
        if self.proposer is not None:
            self._tell_proposer(sched, starts, current.pending)
        return events

    def _process(
        self, sched: SchedulerOutput, rows: list[SampledRow], prompt_rows: dict[int, list[SampledRow]],
        device_round: Optional[int] = None,
    ) -> list[GenerationEvent]:
        """Commit a finished step's results, request by request (``device_round``: the
        scratch bank of a step that settled its verify rows' state itself)."""
        events: list[GenerationEvent] = []
        rows_iter = iter(rows)
        now = time.monotonic()
        for chunk in sched.chunks:
            seq = chunk.seq
            row = next(rows_iter) if chunk.sample else None
            if seq.is_finished:
                continue  # ended while this step was computed ahead: its row is dropped
            tracked = self._requests[seq.request_id]
            if isinstance(row, list):  # a verify row: the tokens its round commits
                events.append(self._commit_round(tracked, chunk, row, now, device_round))
                continue
            self.scheduler.mark_computed(chunk)
            try:
                for r in prompt_rows.get(seq.seq_id, ()):
                    tracked.prompt_logprobs.append(tracked.out.logprobs(r.token_id, r.logprob, r.top_ids, r.top_logprobs))
                if row is not None:
                    events.append(self._commit_token(tracked, row, now))
                else:  # a prefill chunk that is not the prompt's last
                    events.append(self._event(tracked, "", []))
                if not seq.is_finished:  # finishing committed it already
                    self.scheduler.commit(seq)  # publishes pages, captures state snapshots
            except Exception as exc:  # one request's processing failed: fail it alone
                logger.exception("request {} failed while processing its output", seq.request_id)
                events.append(self._error_event(tracked, exc))
        return events

    def _launch_ahead(self, current: InFlight) -> Optional[InFlight]:
        """Queue the decode step after ``current`` now, if it cannot depend on ``current``'s
        tokens on the host (see :mod:`ninfer.engine.decode_ahead`), or the next device round
        behind a device round (:mod:`ninfer.engine.spec.device_rounds`)."""
        if self._decode_ahead and current.pending.is_device_round:
            return self._launch_round_ahead(current)
        if not self._decode_ahead or current.pending.token_ids is None or self.proposer is not None:
            return None
        sched, rows = plan_ahead(current.sched, self.scheduler, self._needs_host_tokens, self.config.max_context)
        if sched is None:
            return None
        ids = current.pending.token_ids
        if len(rows) != ids.shape[0]:
            ids = ids[to_device(rows, torch.int64, ids.device)]
        try:
            following = InFlight(sched, self.runner.launch(sched, ahead_ids=ids), time.perf_counter())
        except Exception:  # launched in the ordinary way next step, where a failure is handled
            logger.opt(exception=True).warning("could not launch a decode step ahead")
            return None
        self.stats.total_steps_ahead += 1
        return following

    def _launch_round_ahead(self, current: InFlight) -> Optional[InFlight]:
        rounds = self.runner.rounds
        sched = plan_round_ahead(current.sched, self.scheduler, self.config.max_context, rounds.width, rounds.banked)
        if sched is None:
            return None
        try:
            following = InFlight(sched, self.runner.launch_round_ahead(sched), time.perf_counter())
        except Exception as exc:
            # unlike a plain step launched ahead, a round may have run on the device already
            # (settling state past what the host has seen): these requests cannot go on
            raise _BatchFailed(current.sched) from exc
        self.stats.total_steps_ahead += 1
        return following

    def _needs_host_tokens(self, seq: Sequence) -> bool:
        """Whether sampling ``seq``'s next token needs its current one on the host first."""
        tracked = self._requests.get(seq.request_id)
        return (
            tracked is None
            or tracked.guided is not None
            or (tracked.budget is not None and tracked.budget.may_close_within(1))  # the token in flight
            or seq.seq_id in self._prompt_logprobs
        )

    def _fail_batch(self, sched: SchedulerOutput, exc: BaseException) -> list[GenerationEvent]:
        logger.opt(exception=exc).error("model step failed; failing its {} requests", len(sched.chunks))
        self._failed_steps += 1
        if self._failed_steps >= MAX_FAILED_STEPS:
            self.dead = f"{MAX_FAILED_STEPS} consecutive model steps failed: {type(exc).__name__}"
        self._in_flight = None  # anything queued behind the failed step shares its requests
        live = [self._requests[c.seq.request_id] for c in sched.chunks if not c.seq.is_finished]
        return [self._error_event(tracked, exc) for tracked in live]
