"""The protocol-neutral pipeline on a real tiny engine: prepare, n choices, events, usage, refusals."""

from __future__ import annotations

import asyncio

import pytest

from ninfer.cli.serve import build_parser
from ninfer.errors import ContextLengthExceededError, InvalidRequestError
from ninfer.frontend.chat_messages import ChatTurn
from ninfer.frontend.output_split import TextDelta
from ninfer.frontend.pipeline import Pipeline
from ninfer.frontend.pipeline_request import ChatPrompt, GenerateRequest, TemplateOptions, TextPrompt
from ninfer.frontend.tool_guide import ToolRequest
from ninfer.plugins import load_registry
from ninfer.profile import load_profile, resolve
from ninfer.profile.flags import overrides_from_args
from ninfer.sampling_params import SamplingParams
from ninfer.server.run import build_state


@pytest.fixture(scope="module")
def state(tiny_qwen3):
    args = build_parser().parse_args(["--model", str(tiny_qwen3), "--device", "cpu", "--max-context", "256",
                                      "--default-thinking-budget", "4"])
    profile = resolve(load_profile(args.profile, args.model, overrides_from_args(args)))
    served = build_state(profile, load_registry(profile.plugins.allow))
    yield served
    served.engine.shutdown()


def run(coro):
    return asyncio.run(coro)


def chat(text="hi", **kw):
    return ChatPrompt([ChatTurn("user", text)], **kw)


async def collect(pipeline, req):
    prepared = await pipeline.prepare(req)
    events = [e async for e in prepared.events()]
    return prepared, events


def test_n_choices_stream_per_choice_events_and_usage(state):
    pipeline = Pipeline(state)
    req = GenerateRequest([chat(options=TemplateOptions(enable=False))], SamplingParams(max_tokens=5, seed=3), n=3)
    prepared, events = run(collect(pipeline, req))
    assert [r.sample_index for r in prepared.requests] == [0, 1, 2]
    assert len({r.request_id for r in prepared.requests}) == 3
    assert {e.index for e in events} == {0, 1, 2} and prepared.finished
    assert [e.first for e in events if e.index == 1].count(True) == 1
    for choice in prepared.choices:
        assert choice.completion_tokens == len(choice.output_ids) <= 5
        assert choice.finish_reason in ("stop", "length")
    usage = prepared.usage()
    assert usage.prompt_tokens == len(prepared.prompts[0].token_ids)  # the shared prompt counts once
    assert usage.completion_tokens == sum(c.completion_tokens for c in prepared.choices)
    assert prepared.timings().predicted_n == usage.completion_tokens
    # thinking off: no budget even with a server default; the prompt says so to the template
    assert prepared.requests[0].thinking is False and prepared.requests[0].thinking_budget is None


def test_thinking_gets_the_server_default_budget_and_raw_prompts_no_splitter(state):
    pipeline = Pipeline(state)
    thinking = run(pipeline.prepare(GenerateRequest([chat(options=TemplateOptions(enable=True))],
                                                    SamplingParams(max_tokens=100))))
    assert thinking.requests[0].thinking_budget.budget == 4
    run(thinking.drain())
    raw = GenerateRequest([TextPrompt(text="hello"), TextPrompt(token_ids=[1, 2, 3])],
                          SamplingParams(max_tokens=2), n=2, prompt_param="prompt")
    prepared, events = run(collect(pipeline, raw))
    assert [c.splitter for c in prepared.choices] == [None] * 4
    assert prepared.prompts[1].token_ids == [1, 2, 3] and prepared.requests[3].prompt_token_ids == [1, 2, 3]
    assert [r.sample_index for r in prepared.requests] == [0, 1, 0, 1]
    text = "".join(d.text for e in events if e.index == 0 for d in e.deltas if isinstance(d, TextDelta))
    assert prepared.usage().prompt_tokens == len(prepared.prompts[0].token_ids) + 3  # each prompt once
    assert isinstance(text, str)


def test_refusals_name_the_protocols_fields(state):
    pipeline = Pipeline(state)
    long = GenerateRequest([TextPrompt(token_ids=[5] * 300)], SamplingParams(max_tokens=1), prompt_param="input")
    with pytest.raises(ContextLengthExceededError) as e:
        run(pipeline.prepare(long))
    assert e.value.param == "input"
    forced = GenerateRequest([chat()], SamplingParams(), tools=ToolRequest((), forced=True, choice_param="tool_choice"))
    with pytest.raises(InvalidRequestError) as e:
        run(pipeline.prepare(forced))
    assert e.value.param == "tool_choice"
    bad_effort = GenerateRequest([chat(options=TemplateOptions(effort="extreme", effort_param="reasoning.effort"))],
                                 SamplingParams())
    with pytest.raises(InvalidRequestError) as e:
        run(pipeline.prepare(bad_effort))
    assert e.value.param == "reasoning.effort"
    # the server default budget cannot close within this output limit: the limit's wire name is blamed
    tight = GenerateRequest([chat(options=TemplateOptions(enable=True))], SamplingParams(max_tokens=20),
                            max_tokens_param="max_output_tokens")
    with pytest.raises(InvalidRequestError) as e:
        run(pipeline.prepare(tight))
    assert (e.value.param, e.value.code) == ("max_output_tokens", "thinking_budget_capacity_insufficient")


def test_rendering_and_tokenizing_run_off_the_event_loop(state):
    """A large body's template and tokenizer work must not hold the loop other clients need."""
    import threading

    pipeline = Pipeline(state)
    seen = []
    render = pipeline.render

    def watched(prompt):
        seen.append(threading.current_thread())
        return render(prompt)

    pipeline.render = watched
    prepared = run(pipeline.prepare(GenerateRequest([chat("x " * 50)], SamplingParams(max_tokens=1))))
    run(prepared.drain())
    assert seen and all(t is not threading.main_thread() for t in seen)


def test_plan_shortens_a_ceiling_max_tokens_and_keeps_the_cache_policy(state):
    from ninfer.frontend.pipeline_request import CachePolicy

    pipeline = Pipeline(state)
    req = GenerateRequest([TextPrompt(token_ids=[5] * 250)], SamplingParams(max_tokens=100), fit_max_tokens=True,
                          cache=CachePolicy(lookup=False, commit=True, commit_generated=False))
    (engine_request,) = pipeline.plan(req, "r").requests
    assert engine_request.params.max_tokens == 6 and req.params.max_tokens == 100  # the caller's params untouched
    assert (engine_request.lookup_prefix_cache, engine_request.commit_prefix_cache,
            engine_request.commit_generated) == (False, True, False)
    assert engine_request.request_id == "r-0"


def test_admission_is_the_pipelines_and_comes_before_the_protocols_lowering(state):
    """A protocol hands over a lowering function: a full server refuses before running it,
    and otherwise it runs in the worker hop with the rest of the preparation."""
    import threading

    from ninfer.errors import ServerOverloadedError
    from ninfer.server.admission import Ticket, reset_current_ticket, set_current_ticket

    pipeline = Pipeline(state)
    ran = []

    def lowering():
        ran.append(threading.current_thread())
        return GenerateRequest([chat()], SamplingParams(max_tokens=1))

    async def in_request(ticket):
        token = set_current_ticket(ticket)
        try:
            return await pipeline.prepare(lowering)
        finally:
            reset_current_ticket(token)

    gate = state.gate
    others = [gate.reserve(Ticket()) for _ in range(gate.capacity - gate.in_flight)]
    with pytest.raises(ServerOverloadedError):
        run(in_request(Ticket()))
    assert ran == []  # refused before any preparation work
    for other in others:
        other.release()
    ticket = Ticket()
    prepared = run(in_request(ticket))
    assert ticket.holds_slot and len(ran) == 1 and ran[0] is not threading.main_thread()
    assert prepared.request_id == ticket.request_id  # the HTTP request's id names the engine requests
    run(prepared.drain())
    ticket.release()


def test_observers_hear_a_refusal_or_one_start_and_exactly_one_end(state):
    """Rejected at admission: no start. Started: one end however the run ends (drained,
    closed early by its reader, or never read before the HTTP request ended)."""
    from ninfer.errors import ServerOverloadedError
    from ninfer.frontend.lifecycle import failure_kind
    from ninfer.server.admission import Ticket, reset_current_ticket, set_current_ticket

    class Recorder:
        def __init__(self):
            self.calls = []

        def rejected(self, rejection):
            self.calls.append(("rejected", rejection.phase, type(rejection.error)))

        def started(self, run):
            self.calls.append(("started", run.request_id))

        def ended(self, run):
            self.calls.append(("ended", run.request_id, "done" if run.finished else failure_kind(run.life.failure)))

    recorder, saved = Recorder(), state.observers
    state.observers = (*saved, recorder)
    pipeline = Pipeline(state)

    async def prepared(ticket, read=None):
        token = set_current_ticket(ticket)
        try:
            req = await pipeline.prepare(GenerateRequest([chat()], SamplingParams(max_tokens=4)))
        finally:
            reset_current_ticket(token)
        if read == "all":
            await req.drain()
        elif read == "one":
            events = req.events()
            await anext(events)
            await events.aclose()  # the reader stops early: the engine requests are aborted
        return req

    try:
        others = [state.gate.reserve(Ticket()) for _ in range(state.gate.capacity - state.gate.in_flight)]
        with pytest.raises(ServerOverloadedError):
            run(prepared(Ticket()))
        for other in others:
            other.release()
        assert recorder.calls == [("rejected", "admission", ServerOverloadedError)]
        tickets = [Ticket(), Ticket(), Ticket()]
        runs = [run(prepared(tickets[0], "all")), run(prepared(tickets[1], "one")), run(prepared(tickets[2]))]
        for ticket in tickets + tickets:  # the end of the HTTP request, twice: still one end each
            ticket.release()
    finally:
        state.observers = saved
    ids = [r.request_id for r in runs]
    assert recorder.calls[1:] == [("started", ids[0]), ("ended", ids[0], "done"),
                                  ("started", ids[1]), ("ended", ids[1], "cancelled"),
                                  ("started", ids[2]), ("ended", ids[2], "not_generated")]
