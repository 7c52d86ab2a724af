"""Anthropic Messages without a server: block assembly from crafted engine events, SSE
framing, stop reasons, error shapes, and request lowering with the tiny checkpoint's
tokenizer.

The tiny random model rarely writes well-formed reasoning or tool markup, so the
renderers get the event sequences an engine would produce for such output;
tests/test_anthropic_messages.py covers the endpoint end to end.
"""

from __future__ import annotations

import asyncio
import json
from importlib import resources
from types import SimpleNamespace

import pytest

from ninfer_plugins.reasoning.qwen3 import QWEN3
from ninfer.engine.request import GenerationEvent, RequestTimings
from ninfer.errors import (
    AuthenticationError,
    EngineDeadError,
    InvalidRequestError,
    NinferError,
    NotFoundError,
    RequestQueueTimeoutError,
    ServerOverloadedError,
    UnsupportedFeatureError,
)
from ninfer.frontend.output_split import OutputSplitter
from ninfer.frontend.tool_schema import ToolSpec
from ninfer.sampling_params import SamplingParams
from ninfer.tiny.tokenizer_files import build_tokenizer
from ninfer.tokenizer import Tokenizer
from ninfer_plugins.protocols.anthropic_messages.errors import error_frame, ninfer_error_body
from ninfer.frontend.choice_output import ChoiceProgress
from ninfer_plugins.protocols.anthropic_messages.output import MessageState, signature
from ninfer_plugins.protocols.anthropic_messages.prepare import count, lower
from ninfer_plugins.protocols.anthropic_messages.schema import decode_request, encoder
from ninfer_plugins.protocols.anthropic_messages.stream import frames
from ninfer_plugins.tool_parsers.hermes_json import HermesJsonToolParser
from _hosts import tokenizer_pipeline

QWEN = QWEN3
WEATHER = ToolSpec("get_weather", {"type": "object", "properties": {"city": {"type": "string"}}})
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>'
TEMPLATE = resources.files("ninfer.tiny").joinpath("chat_template.jinja").read_text(encoding="utf-8")
TOOL = {"name": "get_weather", "description": "weather now",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}


@pytest.fixture(scope="module")
def ctx():
    """The pipeline the routes use, around the tiny tokenizer (Qwen's reasoning parser, no tool parser)."""
    return tokenizer_pipeline(Tokenizer(build_tokenizer(), templates={"default": TEMPLATE}))


def events(pieces: list[str], finish: str = "stop", stop_reason: object = 2, prompt: int = 30, cached: int = 16):
    """Admission, then one event per output piece (the last one finishes)."""
    t = RequestTimings(arrival=0.0, admitted=1.0)
    out = [GenerationEvent("r", [], "", prompt, cached, 0, t, cached)]
    for k, piece in enumerate(pieces):
        last = k == len(pieces) - 1
        out.append(GenerationEvent("r", [k], piece, prompt, cached, k + 1, t, prompt, finished=last,
                                   finish_reason=finish if last else None, stop_reason=stop_reason if last else None))
    return out


def splitter(reasoning: bool = True) -> OutputSplitter:
    return OutputSplitter(QWEN, HermesJsonToolParser([WEATHER]), starts_in_reasoning=reasoning)


def run_stream(state: MessageState, evs) -> list[tuple[str, dict]]:
    async def source():
        for e in evs:
            yield state.choice.feed(e)

    async def collect():
        return [f async for f in frames(state, source(), "msg_1", "m")]

    out = []
    for raw in asyncio.run(collect()):
        name, data = raw.decode().removesuffix("\n\n").split("\n")
        out.append((name.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return out


PIECES = ["Weigh", "ing it\n</th", "ink>\n\nIt is ", "sunny.\n" + CALL[:20], CALL[20:]]


def test_stream_lifecycle_thinking_text_and_tool_use():
    stream = run_stream(MessageState(ChoiceProgress(0, splitter()), 100), events(PIECES))
    names = [n for n, _ in stream]
    assert names == ["message_start", "ping",
                     "content_block_start", "content_block_delta", "content_block_delta", "content_block_delta",
                     "content_block_stop",
                     "content_block_start", "content_block_delta", "content_block_delta", "content_block_stop",
                     "content_block_start", "content_block_delta", "content_block_stop",
                     "message_delta", "message_stop"]
    start = stream[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None
    assert start["usage"] == {"input_tokens": 14, "cache_creation_input_tokens": None, "cache_read_input_tokens": 16,
                              "output_tokens": 0}
    thinking = [d for n, d in stream if n == "content_block_delta" and d["index"] == 0]
    assert "".join(d["delta"].get("thinking", "") for d in thinking) == "Weighing it"
    # the signature comes last, right before the block closes
    assert thinking[-1]["delta"] == {"type": "signature_delta", "signature": signature("Weighing it")}
    assert stream[7][1]["content_block"] == {"type": "text", "text": ""}
    tool_start = stream[11][1]["content_block"]
    assert tool_start["type"] == "tool_use" and tool_start["name"] == "get_weather" and tool_start["input"] == {}
    assert tool_start["id"].startswith("toolu_")
    assert json.loads(stream[12][1]["delta"]["partial_json"]) == {"city": "Paris", "unit": "c"}
    end = stream[-2][1]
    assert end["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert end["usage"]["output_tokens"] == len(PIECES) and end["usage"]["cache_read_input_tokens"] == 16


def test_aggregate_equals_the_concatenated_stream():
    state = MessageState(ChoiceProgress(0, splitter()), 100)
    stream = run_stream(state, events(PIECES))
    message = json.loads(encoder.encode(state.message("msg_1", "m")))
    rebuilt: list[dict] = []
    for name, data in stream:
        if name == "content_block_start":
            rebuilt.append(dict(data["content_block"]))
        elif name == "content_block_delta":
            block, delta = rebuilt[data["index"]], data["delta"]
            kind = delta["type"]
            if kind == "input_json_delta":
                block["_json"] = block.get("_json", "") + delta["partial_json"]
            elif kind == "signature_delta":
                block["signature"] = delta["signature"]
            else:
                field = kind.removesuffix("_delta")
                block[field] += delta[field]
    for block in rebuilt:
        if "_json" in block:
            block["input"] = json.loads(block.pop("_json"))
    assert message["content"] == rebuilt
    assert list(message["content"][2]["input"]) == ["city", "unit"]  # generated member order
    assert message["stop_reason"] == "tool_use" and message["type"] == "message" and message["role"] == "assistant"
    assert [k for k in message][:4] == ["id", "type", "role", "model"]


@pytest.mark.parametrize("finish,stop_reason,max_tokens,expected", [
    ("stop", 2, 100, ("end_turn", None)),
    ("stop", "END", 100, ("stop_sequence", "END")),
    ("length", None, 3, ("max_tokens", None)),
    ("length", None, 50, ("model_context_window_exceeded", None)),
])
def test_stop_reasons(finish, stop_reason, max_tokens, expected):
    state = MessageState(ChoiceProgress(0, splitter(reasoning=False)), max_tokens)
    for e in events(["a", "b", "c"], finish=finish, stop_reason=stop_reason):
        state.feed(state.choice.feed(e))
    assert state.stop() == expected
    assert state.message("m", "x").content == [{"type": "text", "text": "abc"}]


def test_an_engine_error_in_the_stream_is_raised():
    bad = events(["a"])
    bad[-1].error = NinferError("boom")
    with pytest.raises(NinferError):
        run_stream(MessageState(ChoiceProgress(0, splitter()), 10), bad)


# -- request lowering ------------------------------------------------------------------


def prepared(ctx, generate=True, **body):
    """A request the routes' way: lowered and planned by the pipeline, or (a count) rendered."""
    req = decode_request(json.dumps({"model": "m", **body}).encode())
    if not generate:
        rendered = count(req, ctx)
        return SimpleNamespace(prompt=rendered.text, thinking=bool(rendered.thinking), budget=None)
    lowered = lower(req, req.max_tokens or ctx.profile.engine.default_max_tokens)
    (run,) = ctx.plan(lowered.generate_request(SamplingParams(max_tokens=req.max_tokens), None, "r"), "r").requests
    return SimpleNamespace(prompt=run.prompt, thinking=run.thinking, prefill=lowered.prefill,
                           budget=run.thinking_budget, guide=run.params.guided)


def test_history_lowering(ctx):
    p = prepared(ctx, system="S", tools=[TOOL], thinking={"type": "disabled"}, messages=[
        {"role": "user", "content": "a"},
        {"role": "user", "content": [{"type": "text", "text": "b"}]},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "hmm", "signature": "anything"},
            {"type": "text", "text": "Let me"},
            {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"city": "P"}},
            {"type": "tool_use", "id": "t2", "name": "get_weather", "input": {"city": "R"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t2", "content": [{"type": "text", "text": "25C"},
                                                                     {"type": "tool_reference", "tool_name": "x"}]},
            {"type": "tool_result", "tool_use_id": "t1", "content": "no such city", "is_error": True},
            {"type": "text", "text": "thanks"}]},
        {"role": "system", "content": "late"},
        {"role": "assistant", "content": "The weather is"}])
    prompt = p.prompt
    assert "<|im_start|>user\nab<|im_end|>" in prompt  # consecutive user messages joined as-is
    assert prompt.index("Error: no such city") < prompt.index("25C")  # results in call order, error marked
    assert prompt.index("thanks") < prompt.index("<|im_start|>system\nlate") < prompt.index("The weather is")
    assert prompt.endswith("The weather is") and p.prefill and not p.thinking
    assert '"description": "weather now"' in prompt


def test_billing_header_is_consumed_only_as_the_first_system_block(ctx):
    billing = {"type": "text", "text": "x-anthropic-billing-header: cc_version=1; nonce=1",
               "cache_control": {"type": "ephemeral"}}
    rest = {"type": "text", "text": "You are helpful."}
    messages = [{"role": "user", "content": "hi"}]
    first = prepared(ctx, system=[billing, rest], messages=messages)
    other = prepared(ctx, system=[{**billing, "text": billing["text"][:-1] + "2"}, rest], messages=messages)
    plain = prepared(ctx, system=[rest], messages=messages)
    assert first.prompt == other.prompt == plain.prompt and "billing" not in first.prompt
    for system in (billing["text"], [rest, billing]):  # string form or a later block: ordinary text
        assert "x-anthropic-billing-header" in prepared(ctx, system=system, messages=messages).prompt
    inline = [{"role": "system", "content": [billing]}, *messages]
    assert "x-anthropic-billing-header" in prepared(ctx, messages=inline).prompt


def test_thinking_budget_rules(ctx):
    user = [{"role": "user", "content": "q"}]
    p = prepared(ctx, messages=user, max_tokens=3000, thinking={"type": "enabled", "budget_tokens": 2000})
    assert p.thinking and p.budget.budget == 2000
    close = len(ctx.tokenizer.encode(QWEN.budget_close))
    # Claude Code's shape: a budget one below max_tokens is lowered so the close still fits
    tight = prepared(ctx, messages=user, max_tokens=2001, thinking={"type": "enabled", "budget_tokens": 2000})
    opener = 0 if tight.budget.open_at_start else 1  # a model-emitted <think> is output too
    assert tight.budget.budget == 2001 - close - 1 - opener
    assert prepared(ctx, messages=user, thinking={"type": "adaptive"}).budget is None  # no server default
    assert prepared(ctx, messages=user, thinking={"type": "disabled"}).thinking is False
    assert "<think>\n\n</think>" in prepared(ctx, messages=user, thinking={"type": "disabled"}).prompt
    # counting needs no max_tokens, and checks no budget against it
    assert prepared(ctx, False, messages=user, thinking={"type": "enabled", "budget_tokens": 5000}).budget is None


@pytest.mark.parametrize("body,param,unsupported", [
    ({"thinking": {"type": "enabled", "budget_tokens": 1000}}, "thinking.budget_tokens", False),
    ({"thinking": {"type": "enabled", "budget_tokens": 2000}, "max_tokens": 2000}, "thinking.budget_tokens", False),
    ({"thinking": {"type": "enabled", "budget_tokens": 2000, "display": "omitted"}}, "thinking.display", True),
    ({"thinking": {"type": "sometimes"}}, "thinking.type", False),
    ({"output_config": {"effort": "high"}}, "output_config.effort", False),
    ({"output_config": {"format": {"type": "json_object"}}}, "output_config.format.type", False),
    ({"output_format": {"type": "json_schema", "schema": "{}"}}, "output_format.schema", False),
    ({"tool_choice": {"type": "any"}}, "tool_choice", False),  # nothing to call
    ({"tool_choice": {"type": "tool", "name": "get_weather"}}, "tool_choice.name", False),
    ({"tool_choice": {"type": "auto", "disable_parallel_tool_use": "yes"}}, "tool_choice.disable_parallel_tool_use",
     False),
    ({"tools": [{**TOOL, "strict": "yes"}]}, "tools[0].strict", False),
    # this context has no tool parser, so nothing can write the grammar a strict tool needs
    ({"tools": [{**TOOL, "strict": True}]}, "tools[0].input_schema", True),
    ({"tools": [{**TOOL, "defer_loading": True}]}, "tools[0].defer_loading", True),
    ({"tools": [{**TOOL, "allowed_callers": ["code_execution_20250825"]}]}, "tools[0].allowed_callers", True),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0].type", True),
    ({"tools": [{"type": "mcp_toolset", "mcp_server_name": "x"}]}, "tools[0].type", True),
    ({"tools": [{"name": "f", "input_schema": {"type": "array"}}]}, "tools[0].input_schema", False),
    ({"mcp_servers": [{"type": "url", "url": "https://x", "name": "x"}]}, "mcp_servers", True),
    ({"container": "c"}, "container", True),
    ({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]},
     "messages[0].content[0].type", True),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "http://x"}}]}]},
     "messages[0].content[0]", False),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": [
        {"type": "server_tool_use", "id": "s", "name": "web_search", "input": {}}]}]},
     "messages[1].content[0].type", True),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "a", "name": "f", "input": {}}]}, {"role": "user", "content": "no result"}]},
     "messages[2].content", False),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"},
                   {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "zz", "content": "r"}]}]},
     "messages[2].content[0]", False),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "t", "signature": "s"}, {"type": "text", "text": "x"}]}]},
     "messages[1]", False),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "pre"}],
      "thinking": {"type": "enabled", "budget_tokens": 2000}}, "thinking.type", False),
])
def test_rejections_name_their_field(ctx, body, param, unsupported):
    body = {"messages": [{"role": "user", "content": "q"}], "max_tokens": 4000, **body}
    with pytest.raises(InvalidRequestError) as info:
        prepared(ctx, **body)
    assert info.value.param == param
    assert isinstance(info.value, UnsupportedFeatureError) == unsupported


def test_meaningless_blocks_and_advisory_fields_pass(ctx):
    base = prepared(ctx, messages=[{"role": "user", "content": "q"}])
    noisy = prepared(ctx, metadata={"user_id": "u"}, context_management={"edits": []}, service_tier="auto",
                     messages=[{"role": "user", "content": [{"type": "text", "text": "q"},
                                                            {"type": "some_future_block", "x": 1}]}])
    assert noisy.prompt == base.prompt


def test_tool_results_normalised_and_history_starting_with_results(ctx):
    call = {"role": "assistant", "content": [{"type": "tool_use", "id": "a", "name": "get_weather", "input": {}},
                                             {"type": "tool_use", "id": "b", "name": "get_weather", "input": {}}]}
    result = lambda i: {"type": "tool_result", "tool_use_id": i, "content": f"r{i}"}  # noqa: E731
    msgs = [{"role": "user", "content": "q"}, call, {"role": "user", "content": [result("b"), result("a")]}]
    prompt = prepared(ctx, tools=[TOOL], messages=msgs).prompt
    assert prompt.index("ra") < prompt.index("rb")
    with pytest.raises(InvalidRequestError, match="more than one"):
        prepared(ctx, messages=[*msgs[:2], {"role": "user", "content": [result("a"), result("a"), result("b")]}])
    # an imported conversation may begin with results
    assert "r1" in prepared(ctx, messages=[{"role": "user", "content": [result("1"), {"type": "text", "text": "go"}]}]
                            ).prompt


@pytest.mark.parametrize("body,ok", [
    ({"cache_control": {"type": "ephemeral"}}, True),
    ({"cache_control": {"type": "ephemeral", "ttl": "1h"}}, True),
    ({"cache_control": {"type": "ephemeral", "ttl": "2h"}}, False),
    ({"cache_control": {"type": "persistent"}}, False),
])
def test_request_level_cache_control(ctx, body, ok):
    msgs = [{"role": "user", "content": [{"type": "text", "text": "q"}]}]
    if ok:
        prepared(ctx, messages=msgs, **body)
    else:
        with pytest.raises(InvalidRequestError):
            prepared(ctx, messages=msgs, **body)


def test_cache_breakpoint_limits(ctx):
    marked = lambda t, ttl="5m": {"type": "text", "text": t, "cache_control": {"type": "ephemeral", "ttl": ttl}}  # noqa
    four = [{"role": "user", "content": [marked("a"), marked("b"), marked("c"), marked("d")]}]
    prepared(ctx, messages=four)
    # the billing block's marker goes away with the block
    billing = {**marked("x-anthropic-billing-header: n=1")}
    prepared(ctx, system=[billing], messages=four)
    with pytest.raises(InvalidRequestError, match="at most 4"):
        prepared(ctx, system=[{"type": "text", "text": "s", "cache_control": {"type": "ephemeral"}}], messages=four)
    # the request-level marker merges with the same TTL at its target, conflicts with another, needs a 5th slot
    prepared(ctx, messages=four, cache_control={"type": "ephemeral"})
    with pytest.raises(InvalidRequestError, match="conflicts"):
        prepared(ctx, messages=four, cache_control={"type": "ephemeral", "ttl": "1h"})
    shifted = [{"role": "user", "content": [marked("a"), marked("b"), marked("c"), marked("d"),
                                            {"type": "text", "text": "e"}]}]
    with pytest.raises(InvalidRequestError, match="slot"):
        prepared(ctx, messages=shifted, cache_control={"type": "ephemeral"})


# -- errors ------------------------------------------------------------------------------


@pytest.mark.parametrize("exc,status,kind", [
    (ServerOverloadedError("full"), 529, "overloaded_error"),
    (RequestQueueTimeoutError("late"), 504, "timeout_error"),
    (InvalidRequestError("bad", param="max_tokens"), 400, "invalid_request_error"),
    (AuthenticationError("who"), 401, "authentication_error"),
    (NotFoundError("gone"), 404, "not_found_error"),
    (EngineDeadError("dead"), 503, "api_error"),
    (NinferError("bug"), 500, "api_error"),
])
def test_error_statuses_and_types(exc, status, kind):
    got, body = ninfer_error_body(exc, "req_1")
    assert got == status and body["type"] == "error" and body["error"]["type"] == kind
    assert body["request_id"] == "req_1"
    if exc.param:
        assert body["error"]["message"] == f"{exc.param}: {exc.message}"
    name, data = error_frame("req_1", exc).decode().removesuffix("\n\n").split("\n")
    assert name == "event: error" and json.loads(data.removeprefix("data: ")) == body
