"""The one path from a protocol's parsed request to its choices' output events.

Every front door runs the same sequence: admission (a full server answers before any
work), lowering the wire body (when the protocol hands over a function that does it),
prompt rendering with the template options resolved against the template, tokenizing,
the prompt-length refusal, the output guide, the thinking budget, one engine request per
choice (``sample_index`` picks the seed: the engine's one rule), then the interleaved
events of all choices; everything after admission runs off the event loop. A protocol
only parses its body into a :class:`GenerateRequest` and renders the :class:`ChoiceEvent`
stream and the final :class:`UsageCounts` / :class:`TimingCounts`. Being the one path,
it is also where the server's request observers (the JSONL log, the metrics) hear of
each request: its refusal, or its start and one end (:mod:`ninfer.frontend.lifecycle`).
"""

from __future__ import annotations

import time
from contextlib import aclosing
from typing import Any, AsyncIterator, Callable, Optional, Sequence, Union, cast

import attrs
import jinja2

from ninfer.capabilities import ReasoningParser, ToolParser
from ninfer.engine.request import EngineRequest
from ninfer.engine.thinking_budget import ThinkingBudget
from ninfer.errors import InvalidRequestError
from ninfer.frontend.cache_hints import chat_cache_hints
from ninfer.frontend.chat_messages import template_messages
from ninfer.frontend.choice_output import ChoiceEvent, ChoiceProgress, TimingCounts, UsageCounts, timings, usage
from ninfer.frontend.fanout import generate_all
from ninfer.frontend.host import ModelHost, ServingHost
from ninfer.frontend.lifecycle import Lifecycle, Rejection, end_run, notify
from ninfer.frontend.parsers import make_splitter, reasoning_parser, starts_in_reasoning
from ninfer.frontend.pipeline_request import GenerateRequest, Prompt, TextPrompt
from ninfer.frontend.prompt_limits import check_prompt_length, fit_output_limit
from ninfer.frontend.prompt_options import PromptOptions, resolve_options, template_kwargs
from ninfer.frontend.template_caps import TemplateCaps, detect_caps
from ninfer.frontend.thinking import thinking_budget
from ninfer.frontend.tool_guide import request_guide, tool_parser
from ninfer.guided.spec import GuideSpec
from ninfer.server.admission import current_ticket, request_id

#: what :meth:`Pipeline.prepare` takes: the request, or a function lowering the wire body
#: into one (blocking work the pipeline runs off the loop, after admission)
Lowering = Union[GenerateRequest, Callable[[], GenerateRequest]]


@attrs.frozen
class Rendered:
    """A prompt as the engine runs it."""

    text: str
    token_ids: list[int]
    #: whether the request thinks (None: a raw prompt, the process default)
    thinking: Optional[bool] = None
    options: Optional[PromptOptions] = None
    tools: Sequence[dict[str, Any]] = ()


def render_prompt(prompt: Prompt, tokenizer: Any, profile: Any, caps: Optional[TemplateCaps] = None) -> Rendered:
    """Template and tokenize one prompt; a token-id prompt is decoded for its text (blocking).

    A template that refuses the conversation is the request's fault: a 400 naming
    ``prompt.param``.
    """
    if isinstance(prompt, TextPrompt):
        if prompt.token_ids is not None:
            ids = list(prompt.token_ids)
            text = prompt.text if prompt.text is not None else tokenizer.decode(ids, False)
            return Rendered(text, ids, prompt.thinking)
        return Rendered(prompt.text or "", tokenizer.encode(prompt.text or ""), prompt.thinking)
    caps = caps if caps is not None else detect_caps(tokenizer.chat_template_source)
    options = resolve_options(prompt.options, caps, profile.reasoning.thinking, profile.reasoning.preserve_thinking)
    try:
        text = tokenizer.apply_chat_template(
            template_messages(prompt.turns), tools=list(prompt.tools) or None,
            add_generation_prompt=prompt.add_generation_prompt and not prompt.continue_final,
            continue_final_message=prompt.continue_final, **template_kwargs(options, caps))
    except (jinja2.TemplateError, ValueError) as exc:  # the template refused, or dropped a prefill's text
        raise InvalidRequestError(f"the chat template cannot render {prompt.what}: {exc}", param=prompt.param,
                                  code="invalid_prompt") from exc
    ids = prompt.encode(text) if prompt.encode is not None else tokenizer.encode(text)
    return Rendered(text, ids, options.thinking, options, tuple(prompt.tools))


def choose_thinking_budget(tokenizer: Any, parser: Optional[ReasoningParser], profile: Any, max_context: int,
                           req: GenerateRequest, rendered: Rendered,
                           limit: Optional[int] = None) -> Optional[ThinkingBudget]:
    """The request's cap, else the server default, for a prompt that thinks (None: uncapped).

    The output limit it must fit in is ``limit`` (the request's, fitted to the room), else
    the request's, else the one the engine applies; ``max_context`` is what one request can hold.
    """
    asked = req.thinking.budget
    cap = asked if asked is not None else profile.reasoning.default_thinking_budget
    if not rendered.thinking or cap is None or parser is None:
        return None
    room = limit if limit is not None else req.params.max_tokens
    if room is None:
        room = max(min(profile.engine.default_max_tokens, max_context - len(rendered.token_ids)), 0)
    open_at_start = starts_in_reasoning(rendered.text, parser)
    if asked is not None and req.thinking.fit:
        # the close sequence, one answer token, and the opener when the model emits it
        need = len(tokenizer.encode(parser.budget_close)) + 1 + (0 if open_at_start else 1)
        if cap < room < cap + need:
            cap = room - need if room > need else None
    param = req.thinking.param if asked is not None else req.max_tokens_param
    return thinking_budget(tokenizer, parser, cap, room, open_at_start, param=param)


def output_guide(req: GenerateRequest, parser: Optional[ToolParser]) -> Optional[GuideSpec]:
    """The guide every choice follows (blocking: schemas are compiled)."""
    if not (req.tools.tools or req.tools.forced or req.answer is not None):
        return None
    return request_guide(req.tools, req.answer, parser)


class Pipeline:
    """Built once per server from its :class:`ninfer.server.state.ServerState` (or by ``LLM``)."""

    def __init__(self, host: ModelHost):
        self.host = host
        self.tokenizer = host.tokenizer
        self.profile = host.profile
        self.caps: TemplateCaps = detect_caps(host.tokenizer.chat_template_source)
        self.reasoning = reasoning_parser(host)
        self.tool_parser = tool_parser(host)

    def render(self, prompt: Prompt) -> Rendered:
        """:func:`render_prompt` with this server's tokenizer (blocking: run it off the loop).

        Count and tokenize endpoints call it too, so a count is the prompt a run gets.
        """
        return render_prompt(prompt, self.tokenizer, self.profile, self.caps)

    def thinking_budget(self, req: GenerateRequest, rendered: Rendered,
                        limit: Optional[int] = None) -> Optional[ThinkingBudget]:
        return choose_thinking_budget(self.tokenizer, self.reasoning, self.profile, self.max_len, req, rendered,
                                      limit)

    @property
    def max_len(self) -> int:
        """The most tokens one request can hold: the context, or a smaller KV pool."""
        kv = self.host.kv_capacity_tokens
        return self.host.max_model_len if kv is None else min(self.host.max_model_len, kv)

    def _ceiling(self, req: GenerateRequest, prompt_tokens: int) -> Optional[int]:
        """The output limit the thinking budget must close within, before it is checked."""
        asked = req.params.max_tokens
        if req.fit_max_tokens and asked is not None:
            return max(min(asked, self.max_len - prompt_tokens), 0)
        return asked

    def output_limit(self, req: GenerateRequest, prompt_tokens: int) -> Optional[int]:
        """The limit a prompt's engine requests get, or the 400 naming the request's field."""
        return fit_output_limit(prompt_tokens, req.params.max_tokens, self.host.max_model_len,
                                self.host.kv_capacity_tokens, fit=req.fit_max_tokens, prompt_param=req.prompt_param,
                                max_tokens_param=req.max_tokens_param)

    # -- one request ----------------------------------------------------------------
    async def prepare(self, req: Lowering, stream: bool = False) -> Run:
        """Admission, then everything before generation off the event loop (the server's path).

        ``req`` may be a function that lowers the protocol's body (blocking): it runs in
        the same worker hop, after admission, so a full server refuses before that work.
        Errors here are plain HTTP errors. ``stream`` (whether the protocol answers with
        events) is for the host's request observers, which hear of the refusal or the start
        here (:mod:`ninfer.frontend.lifecycle`).
        """
        host = cast(ServingHost, self.host)  # only the server prepares; LLM and the batch runner plan
        ticket = current_ticket()
        rid = request_id()  # read on the loop: the id lives in the request's context
        began = time.monotonic()
        lowered: list[GenerateRequest] = []  # what lowering produced, for a rejection's record
        phase = "admission"
        try:
            if ticket is not None:  # outside an HTTP request a slot is held only while generating
                host.gate.reserve()  # the one admission check: 429 / 503 before any preparation work
            phase = "prepare"
            plan = await host.run_blocking(self._lower_and_plan, req, rid, lowered)
        except Exception as exc:
            notify(host.observers, "rejected", Rejection(rid, ticket, phase, exc, next(iter(lowered), None), stream,
                                                         time.monotonic() - began))
            raise
        life = Lifecycle(host.observers, ticket, lowered[0], stream,
                         ticket.started if ticket is not None else began, time.monotonic() - began)
        run = Run(host, plan.request_id, plan.prompts, plan.requests, plan.choices, plan.n, life)
        notify(host.observers, "started", run)
        if ticket is not None:  # a run whose events are never read still ends once, with the request
            ticket.on_release(lambda: end_run(run, None))
        return run

    def _lower_and_plan(self, req: Lowering, rid: str, lowered: list[GenerateRequest]) -> Plan:
        req = req if isinstance(req, GenerateRequest) else req()
        lowered.append(req)
        return self.plan(req, req.request_id or rid)

    def plan(self, req: GenerateRequest, rid: str) -> Plan:
        """Render, check, guide and fan out one request (blocking): what every caller runs.

        The server runs it off the loop through :meth:`prepare`; ``LLM`` and the batch
        runner call it directly and feed the engine requests to their own engine loop.
        """
        rendered = [self.render(p) for p in req.prompts]
        for r in rendered:
            check_prompt_length(len(r.token_ids), self.host.max_model_len, param=req.prompt_param)
        params = req.params
        guide = output_guide(req, self.tool_parser)
        if guide is not None:
            params = attrs.evolve(params, guided=guide)
        if params.n != 1:  # each choice is its own engine request
            params = attrs.evolve(params, n=1)
        requests, choices = [], []
        for i, r in enumerate(rendered):
            # a guide or thinking-budget refusal names its own field before the output fit does
            budget = self.thinking_budget(req, r, self._ceiling(req, len(r.token_ids)))
            limit = self.output_limit(req, len(r.token_ids))
            if limit != params.max_tokens:  # a ceiling shortened to the room
                params = attrs.evolve(params, max_tokens=limit)
            hints = chat_cache_hints(req.prompts[i], r.token_ids, self.tokenizer, req.cache.replay)
            for j in range(req.n):
                k = i * req.n + j
                requests.append(EngineRequest(
                    f"{rid}-{k}", r.token_ids, params, prompt=r.text, thinking=r.thinking, thinking_budget=budget,
                    lora_name=req.lora, sample_index=j, lookup_prefix_cache=req.cache.lookup,
                    commit_prefix_cache=req.cache.commit, commit_generated=req.cache.commit_generated,
                    speculate=req.speculate, proposal=req.proposal, cache_hints=hints))
                splitter = make_splitter(self.host, r.text, r.tools) if r.options is not None else None
                choices.append(ChoiceProgress(k, splitter))
        return Plan(rid, rendered, requests, choices, req.n)


@attrs.frozen
class Plan:
    """A request made ready for the engine: its prompts, engine requests and choices (prompt-major)."""

    request_id: str
    prompts: list[Rendered]
    requests: list[EngineRequest]
    choices: list[ChoiceProgress]
    n: int = 1


@attrs.define
class Run:
    """One prepared request: its engine requests (prompt-major, ``n`` per prompt) and choices."""

    host: ServingHost
    request_id: str
    prompts: list[Rendered]
    requests: list[EngineRequest]
    choices: list[ChoiceProgress]
    n: int
    #: the request as its observers see it (None: a run made outside the server's prepare)
    life: Optional[Lifecycle] = None

    async def events(self) -> AsyncIterator[ChoiceEvent]:
        """Every choice's events in arrival order; closing this aborts every engine request.

        Nothing comes before the engine admits the first choice, so a refusal at admission
        is still raised here before any output; an event carrying an error raises it.
        When it ends, however it ends, the observers hear of the run's one terminal.
        """
        failure: Optional[BaseException] = None
        try:
            async with aclosing(generate_all(self.host, self.requests)) as events:
                async for index, event in events:
                    yield self.choices[index].feed(event)
        except BaseException as exc:  # noted for the terminal, never swallowed
            failure = exc
            raise
        finally:
            end_run(self, failure)

    async def drain(self) -> None:
        """Run every choice to its end (an aggregate answer reads :attr:`choices` after)."""
        async with aclosing(self.events()) as events:
            async for _ in events:
                pass

    @property
    def finished(self) -> bool:
        return all(c.finished for c in self.choices)

    def usage(self) -> UsageCounts:
        return usage(self.choices, self.n)

    def timings(self) -> TimingCounts:
        return timings(self.choices)
