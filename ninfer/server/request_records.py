"""The request events of the JSONL request log, built from a pipeline run: counts and seconds only.

Nothing here copies request or response content: no prompt or output text, no tool
arguments, no stop strings, no key values. Requests are described by their shape (how
many messages and tools, which options were set) and outcomes by counters and
unrounded seconds (monotonic clock differences). docs/server.md lists every field.
"""

from __future__ import annotations

from typing import Any, Optional

from ninfer.engine.request import RequestTimings
from ninfer.errors import NinferError
from ninfer.frontend.choice_output import ChoiceProgress
from ninfer.frontend.lifecycle import Rejection, failure_kind
from ninfer.frontend.pipeline import Rendered, Run
from ninfer.frontend.pipeline_request import ChatPrompt, GenerateRequest
from ninfer.frontend.prompt_options import TemplateOptions
from ninfer.sampling_schema import PRESET_FIELDS
from ninfer.server.errors import INTERNAL_MESSAGE, error_type
from ninfer.server.middleware import CORE_PROTOCOL, ERROR_VIEW_OPT, PROTOCOL_OPT

#: sampler fields a request may set (copied when set: numbers, never text)
_SAMPLER_FIELDS = (*PRESET_FIELDS, "seed", "max_tokens", "min_tokens", "logprobs", "prompt_logprobs")


def route(ticket: Any) -> dict[str, Optional[str]]:
    """The protocol plugin whose route served the request, and the request path."""
    scope = getattr(ticket, "scope", None) or {}
    handler = scope.get("route_handler")
    protocol = handler.opt.get(PROTOCOL_OPT, CORE_PROTOCOL) if handler is not None else None
    return {"protocol": protocol, "endpoint": scope.get("path")}


def body_bytes(ticket: Any) -> Optional[int]:
    """The request body's declared size (None: no ``content-length``, e.g. a chunked upload)."""
    scope = getattr(ticket, "scope", None) or {}
    for name, value in scope.get("headers", ()):
        if name == b"content-length" and value.isdigit():
            return int(value)
    return None


def error_fields(error: BaseException, ticket: Any = None) -> dict[str, Any]:
    """Status, type, code, parameter and message of an error as the client got it.

    A protocol with its own error answers says what they are (``ERROR_VIEW_OPT`` on the
    route that served ``ticket``); otherwise the core's answer: typed errors carry their
    own (their messages name fields and counts), anything else is the fixed 500.
    """
    scope = getattr(ticket, "scope", None) or {}
    handler = scope.get("route_handler")
    view = handler.opt.get(ERROR_VIEW_OPT) if handler is not None else None
    if view is not None:
        return view(error)
    if isinstance(error, NinferError):
        return {"status": error.status, "type": error_type(error.status), "code": error.code, "param": error.param,
                "message": error.message}
    return {"status": 500, "type": error_type(500), "code": "internal_error", "param": None,
            "message": INTERNAL_MESSAGE}


def _options(req: GenerateRequest) -> Optional[TemplateOptions]:
    first = req.prompts[0] if req.prompts else None
    return first.options if isinstance(first, ChatPrompt) else None


def shape(req: GenerateRequest, stream: bool) -> dict[str, Any]:
    """How the request is built, without its content."""
    chat = [p for p in req.prompts if isinstance(p, ChatPrompt)]
    params = req.params
    return {
        "stream": stream,
        "prompt_kind": "chat" if chat else "text",
        "prompts": len(req.prompts),
        "messages": sum(len(p.turns) for p in chat) if chat else None,
        "continue_final": any(p.continue_final for p in chat),
        "n": req.n,
        "tools": len(req.tools.tools),
        "tool_choice_forced": req.tools.forced,
        "parallel_tool_calls": req.tools.parallel,
        "answer_format": req.answer.kind if req.answer is not None else None,
        "guided": params.guided.kind if params.guided is not None else None,
        "stop_strings": len(params.stop),
        "stop_token_ids": len(params.stop_token_ids),
        "logit_bias_entries": len(params.logit_bias),
        "lora": req.lora,
        "speculate": req.speculate,
        "sampler": {name: getattr(params, name) for name in _SAMPLER_FIELDS if getattr(params, name) is not None
                    and not (name == "min_tokens" and params.min_tokens == 0)},  # 0 is min_tokens' unset
    }


def requested_reasoning(req: Optional[GenerateRequest]) -> dict[str, Any]:
    options = _options(req) if req is not None else None
    return {
        "requested_reasoning_effort": options.effort if options is not None else None,
        "requested_thinking": options.enable if options is not None else None,
        "requested_thinking_budget": req.thinking.budget if req is not None else None,
    }


def resolved_effort(rendered: Rendered) -> Optional[str]:
    """The effort the template ran with: "none" when the request does not think (the options
    then pass the template no effort at all), null for a raw prompt or a template without tiers."""
    options = rendered.options
    if options is None:
        return None
    return options.effort if rendered.thinking else "none"


def start_fields(run: Run, output_limit: int, max_context: int) -> dict[str, Any]:
    """request_start: the prepared request's shape, resolved reasoning and output budget."""
    life = run.life
    assert life is not None
    first = run.prompts[0]
    options = first.options
    budget = run.requests[0].thinking_budget
    requested = life.request.params.max_tokens
    prompt_tokens = len(first.token_ids)
    kv = run.host.kv_capacity_tokens
    holds = max_context if kv is None else min(max_context, kv)  # what one request can hold
    return {
        **route(life.ticket),
        "engine_request_id": run.request_id,
        "shape": shape(life.request, life.stream),
        "prompt_tokens": sum(len(p.token_ids) for p in run.prompts),
        "reasoning": {
            **requested_reasoning(life.request),
            "resolved_reasoning_effort": resolved_effort(first),
            "thinking": first.thinking,
            "preserve_thinking": options.preserve_thinking if options is not None else None,
            "thinking_budget": budget.budget if budget is not None else None,
        },
        "output_budget": {
            "requested_max_tokens": requested,
            # what the engine applies: the request's limit, else the default within the context and pool
            "effective_max_tokens": run.requests[0].params.max_tokens
            if run.requests[0].params.max_tokens is not None
            else max(min(output_limit, holds - prompt_tokens), 0),
        },
        "engine_requests": len(run.requests),
        "body_bytes": body_bytes(life.ticket),
        "prepare_seconds": life.prepare_seconds,
    }


def rejected_fields(rejection: Rejection) -> dict[str, Any]:
    """request_rejected: what was parsed, the phase, and the error exactly as answered."""
    req = rejection.request
    return {
        **route(rejection.ticket),
        "phase": rejection.phase,
        "shape": shape(req, rejection.stream) if req is not None else None,
        **requested_reasoning(req),
        "resolved_reasoning_effort": None,  # never resolved for a refused request
        "media_items": 0,  # this build accepts no media
        "error": error_fields(rejection.error, rejection.ticket),
        "prepare_seconds": rejection.prepare_seconds,
    }


def _diff(later: Optional[float], earlier: Optional[float]) -> Optional[float]:
    return later - earlier if later is not None and earlier is not None else None


def _engine_timing(t: Optional[RequestTimings]) -> Optional[dict[str, Any]]:
    if t is None:
        return None
    e = t.exposure
    return {
        "queue_wait_seconds": _diff(t.admitted, t.arrival),
        "device_wait_exposed_seconds": e.device_wait_seconds,
        "host_exposed_seconds": {"submit": e.submit_seconds, "commit": e.commit_seconds,
                                 "total": e.submit_seconds + e.commit_seconds},
        "decode": {"host_seconds": e.decode_host_seconds, "device_wait_seconds": e.decode_device_wait_seconds,
                   "steps": e.decode_steps},
        "units": {"steps": e.steps, "prefill_steps": e.prefill_steps, "decode_steps": e.decode_steps},
    }


def _speculative(t: Optional[RequestTimings], backend: Optional[str], window: int) -> Optional[dict[str, Any]]:
    if backend is None:
        return None
    rounds = t.draft_rounds if t is not None else 0
    return {
        "backend": backend,
        "draft_window": window,
        "rounds": rounds,
        "drafted_tokens": t.draft_tokens if t is not None else 0,
        "accepted_tokens": t.draft_accepted if t is not None else 0,
        # decode steps this request took without a draft (a plain step while speculation is on)
        "fallback_steps": max(t.exposure.decode_steps - rounds, 0) if t is not None else 0,
        "accepted_per_position": list(t.accepted_per_position) if t is not None else [],
    }


def _thinking_budget(run: Run, k: int) -> Optional[dict[str, Any]]:
    budget = run.requests[k].thinking_budget
    if budget is None:
        return None
    t = run.choices[k].timings
    return {"budget": budget.budget, "counted_tokens": t.thinking_counted if t is not None else None,
            "forced_close": t.thinking_forced if t is not None else False}


def _tool_call_parse(choice: ChoiceProgress) -> Optional[dict[str, Any]]:
    splitter = choice.splitter
    return splitter.tool_call_parse if splitter is not None else None


def _sampler(t: Optional[RequestTimings]) -> Optional[dict[str, Any]]:
    s = t.sampling if t is not None else None
    if s is None:
        return None
    return {name: getattr(s, name) for name in (*PRESET_FIELDS, "seed")}


def _choice(run: Run, k: int, backend: Optional[str], window: int) -> dict[str, Any]:
    c = run.choices[k]
    t = c.timings
    stop = c.stop_reason
    return {
        "index": k,
        "finish_reason": c.finish_reason,
        "stop_reason_kind": None if stop is None else "token" if isinstance(stop, int) else "string",
        "prompt_tokens": c.prompt_tokens,
        "cached_tokens": c.cached_tokens,
        "completion_tokens": c.completion_tokens,
        "reasoning_tokens": c.reasoning_tokens,
        "sampler": _sampler(t),
        "ttft_seconds": _diff(t.first_token if t else None, run.life.arrived if run.life else None),
        "engine_timing": _engine_timing(t),
        "speculative": _speculative(t, backend, window) if run.requests[k].speculate else None,
        "thinking_budget": _thinking_budget(run, k),
        "tool_call_parse": _tool_call_parse(c),
    }


def _merged_tool_parse(parts: list[dict[str, Any]]) -> Optional[dict[str, Any]]:
    if not parts:
        return None
    reasons = [p["fallback_reason"] for p in parts if p["fallback_reason"] != "none"]
    return {
        "marker_seen": any(p["marker_seen"] for p in parts),
        "calls": sum(p["calls"] for p in parts),
        "omitted_empty_args": sum(p["omitted_empty_args"] for p in parts),
        "mismatched_args": sum(p["mismatched_args"] for p in parts),
        "fallback_reason": reasons[0] if reasons else "none",
    }


def _summed_speculative(choices: list[dict[str, Any]]) -> Optional[dict[str, Any]]:
    parts = [c["speculative"] for c in choices if c["speculative"] is not None]
    if not parts:
        return None
    per_position: list[int] = []
    for p in parts:
        for i, n in enumerate(p["accepted_per_position"]):
            per_position += [0] * (i + 1 - len(per_position))
            per_position[i] += n
    summed = {k: sum(p[k] for p in parts) for k in ("rounds", "drafted_tokens", "accepted_tokens", "fallback_steps")}
    return {"backend": parts[0]["backend"], "draft_window": parts[0]["draft_window"], **summed,
            "accepted_per_position": per_position}


def reuse_path(run: Run) -> Optional[str]:
    """Which checkpoint the first choice's prefix hit came from (ninfer.engine.context_cache.PATHS);
    None when it was never admitted."""
    t = run.choices[0].timings if run.choices else None
    return t.reuse_path if t is not None else None


def outcome_fields(run: Run, backend: Optional[str], window: int) -> dict[str, Any]:
    """What request_done and request_error share: counts, reuse, unrounded seconds, per-choice detail."""
    life = run.life
    assert life is not None
    usage = run.usage()
    choices = [_choice(run, k, backend, window) for k in range(len(run.choices))]
    first = run.choices[0]
    t = first.timings
    firsts = [c.timings.first_token for c in run.choices if c.timings and c.timings.first_token is not None]
    lasts = [c.timings.last_token for c in run.choices if c.timings and c.timings.last_token is not None]
    path = reuse_path(run)
    return {
        **route(life.ticket),
        "engine_request_id": run.request_id,
        "stream": life.stream,
        "result": {
            "finish_reason": first.finish_reason,
            "prompt_tokens": usage.prompt_tokens,
            "cached_tokens": usage.cached_tokens,
            "computed_prefill_tokens": usage.prompt_tokens - usage.cached_tokens,
            "completion_tokens": usage.completion_tokens,
            "reasoning_tokens": usage.reasoning_tokens,
            "tool_call_parse": _merged_tool_parse([c["tool_call_parse"] for c in choices if c["tool_call_parse"]]),
        },
        "prefix_reuse": {"path": path, "cached_tokens": usage.cached_tokens},
        # the spec's names for the same two figures
        "prefix_reuse_path": path,
        "prefix_cache_hit_tokens": usage.cached_tokens,
        "timings_seconds": {
            "prepare": life.prepare_seconds,
            "queue_wait": _diff(t.admitted, t.arrival) if t is not None else None,
            "ttft": min(firsts) - life.arrived if firsts else None,
            "vision": None,  # this build has no media input
            "prefill": _diff(t.first_token, t.admitted) if t is not None else None,
            "decode": max(lasts) - min(firsts) if firsts and lasts else None,
            "total": _diff(life.ended_at, life.arrived),
            "speculative": _summed_speculative(choices),
        },
        "engine_timing": choices[0]["engine_timing"],
        "thinking_budget": choices[0]["thinking_budget"],
        "choices": choices,
    }


def error_terminal_fields(run: Run, ticket_error_code: Optional[str]) -> dict[str, Any]:
    """request_error's own fields: how it ended and the terminal message."""
    life = run.life
    assert life is not None
    kind = failure_kind(life.failure)
    if kind == "error":
        error: Optional[dict[str, Any]] = error_fields(life.failure, life.ticket)  # type: ignore[arg-type]
        message = error["message"]
    elif kind == "cancelled":
        error, message = None, "cancelled before the outcome: the client went away or stopped reading"
    else:
        error = None
        message = "the response ended before its generation was read"
        if ticket_error_code is not None:
            message += f" (it ended with {ticket_error_code})"
    return {"kind": kind, "error": error, "message": message}
