"""Running a parsed batch on an :class:`ninfer.LLM`'s engine.

Each request goes through the generation pipeline every front door shares
(:mod:`ninfer.frontend.pipeline`: rendering, the prompt-length check, the thinking
budget, the engine request); the runner then feeds the engine directly
(``add_request`` / ``step``) and keeps at most
``batch_size`` requests in flight: a finished request's slot is refilled at once, in
input order, and results are stored by input position. A request that cannot run
(media content, a guide that does not compile, an adapter this build cannot load, a
prompt too long for the context) gets an error result; the others still run.

Prompt rule without the chat template: the text of every message, in order, joined
with nothing between them; roles are dropped and a content array contributes its text
parts in order. The generation prompt and thinking switch only shape templated prompts.

Log probabilities are batch-uniform as the input format asks: requests are grouped by
input position into consecutive groups of ``batch_size``, and every request of a group
receives the largest ``num_logprobs`` any of them asked for.

A request's error names the input field at fault, like the input file's own errors: the
guide's path for a guide the backend refuses, ``requests[i].messages`` for the prompt,
``max_generate_length`` for the output length, ``available_lora_weights["name"]`` for an
adapter that did not load (each adapter loads on its own, so a broken one fails only the
requests naming it).

Sampling: the format sets temperature, top_p and top_k (with its own defaults); every
other sampler setting is neutral unless a process flag sets it, so a model family's preset
(a presence penalty, say) cannot change what the file asked for.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from loguru import logger
from tqdm import tqdm

from ninfer.batch.guides import guide_spec
from ninfer.batch.lora_hook import apply_lora
from ninfer.batch.schema import BatchInput, BatchRequest
from ninfer.engine.defaults import resolve_sampling
from ninfer.engine.request import EngineRequest, GenerationEvent
from ninfer.errors import EngineDeadError, NinferError
from ninfer.frontend.chat_messages import parse_messages
from ninfer.frontend.pipeline_request import CachePolicy, ChatPrompt, GenerateRequest, Prompt, TemplateOptions, TextPrompt
from ninfer.model.family import SamplingDefaults, SamplingPresets
from ninfer.outputs import TokenLogprob
from ninfer.sampling_params import SamplingParams
from ninfer.sampling_schema import PRESET_FIELDS

#: the input format's sampler defaults, used when neither the file nor the profile sets one
DEFAULT_TEMPERATURE = 1.0
DEFAULT_TOP_P = 0.8
DEFAULT_TOP_K = 50
#: the format's sampler defaults; every other field neutral (no penalty, no min_p) unless a flag sets it
_FORMAT = SamplingDefaults(temperature=DEFAULT_TEMPERATURE, top_p=DEFAULT_TOP_P, top_k=DEFAULT_TOP_K)
#: engine finish reasons -> the names results use (stop is split by what stopped it)
_FINISH_NAMES = {"length": "length", "abort": "aborted", "error": "error"}

Warn = Callable[[str], None]


def _stderr_warning(message: str) -> None:
    print(f"ninfer-run: warning: {message}", file=sys.stderr)


class RequestFailed(Exception):
    """A request that cannot run; its message becomes the result's error."""


@dataclass
class RequestResult:
    """What one request produced, or why it could not run."""

    index: int
    output_text: str = ""
    #: stop-words | end-of-sequence | length | error | aborted
    finish_reason: Optional[str] = None
    #: the matched stop string or end-of-sequence token id
    stop_reason: Any = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generated_tokens: int = 0
    #: per generated token, the top candidates (best first); None when not asked for
    logprobs: Optional[list[list[TokenLogprob]]] = None
    error: Optional[str] = None
    first_token_s: Optional[float] = None
    total_s: Optional[float] = None


@dataclass
class BatchRun:
    results: list[RequestResult]
    seconds: float
    #: requests that asked to skip speculative decoding (honoured per request)
    spec_decode_disabled: int = 0
    warnings: list[str] = field(default_factory=list)
    #: the speculative backend (None: none loaded), and its rounds, drafts and kept drafts
    spec_backend: Optional[str] = None
    spec_rounds: int = 0
    spec_drafted: int = 0
    spec_accepted: int = 0
    #: requests decoded together: batch_size, or less where the engine's limit is lower
    batch_size: int = 1
    #: the sampler settings every request used (what the presets/flags/file resolved to)
    sampling: dict[str, Any] = field(default_factory=dict)


def logprob_widths(batch: BatchInput) -> list[int]:
    """Per request, the K it receives: the largest ``num_logprobs`` of its input group."""
    size, reqs = batch.batch_size, batch.requests
    group_max = [max(r.num_logprobs for r in reqs[start:start + size]) for start in range(0, len(reqs), size)]
    return [group_max[r.index // size] for r in reqs]


def engine_supports_lora() -> bool:
    """Whether engine requests can name a LoRA adapter in this build."""
    return "lora_name" in {f.name for f in dataclasses.fields(EngineRequest)}


def message_text(content: Any) -> str:
    """A message's text: the string itself, or its text parts joined in order."""
    if isinstance(content, str):
        return content
    return "".join(item["text"] for item in content if item.get("type") == "text")


def batch_prompt(batch: BatchInput, req: BatchRequest) -> Prompt:
    """The prompt of a request for the pipeline (see the module docstring for the raw rule)."""
    if not batch.apply_chat_template:
        return TextPrompt("".join(message_text(m["content"]) for m in req.messages), thinking=batch.enable_thinking)
    messages = [{"role": m["role"], "content": message_text(m["content"])} for m in req.messages]
    return ChatPrompt(parse_messages(messages, param=f"requests[{req.index}].messages"),
                      options=TemplateOptions(enable=batch.enable_thinking),
                      add_generation_prompt=batch.add_generation_prompt, param=f"requests[{req.index}].messages")


class _Preparer:
    """Turns parsed requests into engine requests, with the run-wide facts they need."""

    def __init__(self, llm: Any, batch: BatchInput, lora_errors: Optional[dict[str, str]] = None):
        self.llm, self.batch, self.lora_errors = llm, batch, lora_errors or {}
        self.widths = logprob_widths(batch)
        self.vocab_size: int = llm.engine.vocab_size
        self.lora_field = engine_supports_lora()
        # resolved once, every field set on each request: the file's values, else the process
        # flags, else the format's defaults (neutral beyond them), so no family preset applies
        asked = SamplingParams(temperature=batch.temperature, top_p=batch.top_p, top_k=batch.top_k)
        resolved = resolve_sampling(asked, SamplingPresets(_FORMAT, _FORMAT), False,
                                    llm.engine.config.process_sampling)
        #: what every request samples with (the summary reports it)
        self.sampler = {name: getattr(resolved, name) for name in PRESET_FIELDS}

    def check_support(self, req: BatchRequest) -> None:
        if req.media_item is not None:
            kind, path = req.media_item
            raise RequestFailed(f"{kind} content is not supported in this build ({path}); only text parts run")
        if req.lora_name is not None and not self.lora_field:
            raise RequestFailed("LoRA is not available in this build")
        if req.lora_name in self.lora_errors:
            raise RequestFailed(self.lora_errors[req.lora_name])

    def __call__(self, req: BatchRequest) -> EngineRequest:
        self.check_support(req)
        k = self.widths[req.index]
        params = SamplingParams(
            **self.sampler,
            seed=req.sampling_seed,
            max_tokens=self.batch.max_generate_length,
            stop=list(req.stop),
            logprobs=k if k > 0 else None,
            logit_bias={t: b for t, b in req.logit_bias.items() if t < self.vocab_size},
            guided=guide_spec(req.guided_decoding, req.guided_decoding_path) if req.guided_decoding else None,
        )
        use_cache = self.batch.lookup_policy == "use_cache"
        cache = CachePolicy(lookup=use_cache, commit=use_cache,
                            commit_generated=self.batch.commit_policy == "including_generated_tokens")
        request = GenerateRequest([batch_prompt(self.batch, req)], params, lora=req.lora_name, cache=cache,
                                  fit_max_tokens=True, speculate=not req.disable_spec_decode,
                                  proposal=self.batch.spec_proposal_sampling,
                                  prompt_param=f"requests[{req.index}].messages", max_tokens_param="max_generate_length")
        (engine_request,) = self.llm.pipeline.plan(request, f"batch-{req.index}").requests
        return engine_request


def _lora_path(name: str) -> str:
    return f"available_lora_weights[{json.dumps(name)}]"


def _load_adapters(llm: Any, batch: BatchInput, warn: Warn) -> tuple[dict[str, str], list[str]]:
    """Load each declared adapter on its own: ``({name: error}, warnings)``.

    A broken adapter fails only the requests naming it; it is also a warning, so one no
    request names is still reported.
    """
    if not engine_supports_lora():
        return {}, []  # requests naming an adapter fail with "not available" instead
    errors: dict[str, str] = {}
    warnings: list[str] = []
    for name, path in batch.available_lora_weights.items():
        try:
            apply_lora(llm, {name: path})
        except Exception as e:  # noqa: BLE001 - whatever the hook raises is reported per adapter
            errors[name] = f"{_lora_path(name)}: cannot load the adapter: {e}"
            users = sum(r.lora_name == name for r in batch.requests)
            fate = f"the {users} request(s) naming it fail" if users else "no request names it"
            warnings.append(f"{errors[name]} ({fate})")
            warn(warnings[-1])
    return errors, warnings


def _warn_outside_vocab(batch: BatchInput, vocab_size: int, warn: Warn) -> list[str]:
    ids = sorted({t for r in batch.requests for t in r.logit_bias if t >= vocab_size})
    messages = [f"logit_bias token id {t} is outside the vocabulary ({vocab_size} tokens); ignored" for t in ids]
    for message in messages:
        warn(message)
    return messages


def _record(result: RequestResult, event: GenerationEvent) -> None:
    result.output_text += event.text
    if event.logprobs and result.logprobs is not None:
        result.logprobs += [position.top for position in event.logprobs]
    result.prompt_tokens = event.num_prompt_tokens
    result.cached_tokens = event.num_cached_tokens
    result.generated_tokens = event.num_output_tokens
    t = event.timings
    if t.first_token is not None:
        result.first_token_s = t.first_token - t.arrival
    if not event.finished:
        return
    result.total_s = time.monotonic() - t.arrival
    if event.finish_reason == "stop":
        result.finish_reason = "stop-words" if isinstance(event.stop_reason, str) else "end-of-sequence"
        result.stop_reason = event.stop_reason
    else:
        result.finish_reason = _FINISH_NAMES.get(event.finish_reason or "error", event.finish_reason)
    if event.error is not None:
        result.error = event.error.message


def _field_path(param: Optional[str], req: BatchRequest, engine_req: Optional[EngineRequest]) -> Optional[str]:
    """The input-file path of the field an error names (the engine speaks of its own fields)."""
    if param is None:
        return None
    guide = engine_req.params.guided if engine_req is not None else None
    if guide is not None and (param == guide.param or param.startswith(guide.param + ".")):
        return param
    if param.startswith(f"requests[{req.index}]") or param == "max_generate_length":
        return param
    if param in ("prompt", "messages", "prompt_token_ids"):
        return f"requests[{req.index}].messages"
    if param == "max_tokens":
        return "max_generate_length"
    if param == "lora_name":
        return f"requests[{req.index}].lora_name"
    return None


def _error_text(error: Exception, req: BatchRequest, engine_req: Optional[EngineRequest]) -> str:
    """The result's error, led by the input field at fault."""
    message = getattr(error, "message", None) or str(error)
    path = _field_path(getattr(error, "param", None), req, engine_req)
    if path is None or message.startswith(path):
        return message
    return f"{path}: {message}"


def _fail(result: RequestResult, message: str) -> None:
    result.finish_reason, result.error = "error", message


def run_batch(llm: Any, batch: BatchInput, *, progress: bool = False, warn: Warn = _stderr_warning) -> BatchRun:
    """Run every request of ``batch`` on ``llm.engine``; results keep input order."""
    engine = llm.engine
    warnings = _warn_outside_vocab(batch, engine.vocab_size, warn)

    def note(message: str) -> None:
        warn(message)
        warnings.append(message)

    backend = llm.profile.speculative.backend if engine.proposer is not None else None
    probabilistic = batch.spec_proposal_sampling == "probabilistic"
    if backend is not None and probabilistic and not hasattr(engine.proposer, "draft_probs"):
        # a proposer without a distribution of its own (ngram) can only propose greedily;
        # verification keeps sampled outputs exact either way
        note(f"spec_proposal_sampling: the {backend} backend has no proposal distribution; it proposes "
             "greedily (outputs are still sampled exactly)")
    # the engine decodes at most max_concurrency requests together (the CLI asks for batch_size,
    # within the profile's limit); more in flight would only queue inside the engine
    limit = llm.profile.engine.max_concurrency
    batch_size = min(batch.batch_size, limit)
    if batch.batch_size > limit:
        note(f"batch_size: {batch.batch_size} is more than the engine decodes together "
             f"(max_concurrency {limit}); {limit} requests run at a time")
    before = (engine.stats.total_rounds, engine.stats.total_drafted, engine.stats.total_accepted)
    lora_errors, lora_warnings = _load_adapters(llm, batch, warn)
    warnings += lora_warnings
    prepare = _Preparer(llm, batch, lora_errors)
    sampling = prepare.sampler
    logger.info("sampling: {}", ", ".join(f"{k}={v}" for k, v in sampling.items()))
    results = [RequestResult(r.index) for r in batch.requests]
    for result, k in zip(results, prepare.widths):
        result.logprobs = [] if k > 0 else None
    queue = deque(batch.requests)
    in_flight: dict[str, RequestResult] = {}
    started = time.perf_counter()
    with tqdm(total=len(results), unit="req", file=sys.stderr, disable=not progress, dynamic_ncols=True) as bar:
        try:
            while queue or in_flight:
                while queue and len(in_flight) < batch_size:
                    req = queue.popleft()
                    engine_req = None
                    try:
                        engine_req = prepare(req)
                        engine.add_request(engine_req)
                    except (RequestFailed, NinferError, ValueError) as e:
                        _fail(results[req.index], _error_text(e, req, engine_req))
                        bar.update(1)
                        continue
                    in_flight[engine_req.request_id] = results[req.index]
                events = engine.step()
                if engine.dead:
                    events += engine.fail_all(EngineDeadError(f"engine failed: {engine.dead}"))
                for event in events:
                    _record(in_flight[event.request_id], event)
                    if event.finished:
                        del in_flight[event.request_id]
                        bar.update(1)
                if engine.dead:
                    for req in queue:
                        _fail(results[req.index], f"engine failed: {engine.dead}")
                    break
        except BaseException:
            for request_id in in_flight:
                engine.abort_request(request_id)
            raise
    disabled = sum(r.disable_spec_decode for r in batch.requests)
    after = (engine.stats.total_rounds, engine.stats.total_drafted, engine.stats.total_accepted)
    rounds, drafted, accepted = (b - a for a, b in zip(before, after))
    return BatchRun(results, time.perf_counter() - started, disabled, warnings, backend, rounds, drafted, accepted,
                    batch_size, sampling)
