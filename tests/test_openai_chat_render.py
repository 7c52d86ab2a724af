"""Chat completion renderers (aggregate JSON and SSE chunks) fed crafted engine events.

The tiny random model rarely writes well-formed reasoning or tool markup, so these
tests hand the renderers the event sequences an engine would produce for such output;
tests/test_openai_chat.py covers the endpoint end to end.
"""

from __future__ import annotations

import asyncio
import json
from importlib import resources
from types import SimpleNamespace
import math

import msgspec
import pytest

from ninfer_plugins.reasoning.qwen3 import QWEN3
from ninfer.engine.request import GenerationEvent, RequestTimings
from ninfer.frontend.output_split import OutputSplitter, ToolCallStart
from ninfer.frontend.tool_schema import ToolSpec
from ninfer.outputs import PositionLogprobs, TokenLogprob
from ninfer.tiny.tokenizer_files import build_tokenizer
from ninfer.tokenizer import Tokenizer
from ninfer.errors import InvalidRequestError
from ninfer.frontend.prompt_options import resolve_options
from ninfer.frontend.template_caps import detect_caps
from ninfer.plugins import load_registry
from ninfer.profile.schema import Profile, Tools
from ninfer.frontend.choice_output import ChoiceProgress
from ninfer_plugins.protocols.openai_chat.choice import wire_logprobs
from ninfer.frontend.parsers import make_splitter, starts_in_reasoning
from ninfer_plugins.protocols.openai_chat.render import MessageBuilder, completion
from ninfer_plugins.protocols.openai_chat.schema import ChatCompletionRequest
from ninfer_plugins.protocols.openai_chat.stream import ChunkStream, chunks
from ninfer_plugins.protocols.openai_chat.translate import chat_prompt, sampling_params, template_options
from ninfer_plugins.tool_parsers.hermes_json import HermesJsonToolParser
from _hosts import tokenizer_pipeline

QWEN = QWEN3
WEATHER = ToolSpec("get_weather", {"type": "object", "properties": {"city": {"type": "string"}}})
TINY_TEMPLATE = resources.files("ninfer.tiny").joinpath("chat_template.jinja").read_text(encoding="utf-8")
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>'


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer(build_tokenizer())


def crafted(pieces: list[str], prompt: int = 12, cached: int = 4, finish: str = "stop", logprobs: bool = False):
    """Admission, one prefill chunk, then one event per output piece (the last finishes)."""
    t = RequestTimings(arrival=0.0, admitted=1.0, first_token=1.5 if pieces else None,
                       last_token=2.0 if pieces else None)

    def event(text="", ids=(), processed=prompt, n_out=0, done=False):
        lp = [PositionLogprobs(i, -0.5, [TokenLogprob(i, "x", [120], -0.5)]) for i in ids] if logprobs else None
        return GenerationEvent("r", list(ids), text, prompt, cached, n_out, t, processed, lp, done,
                               finish if done else None)

    out = [event(processed=cached), event(processed=(cached + prompt) // 2)]
    for k, piece in enumerate(pieces):
        out.append(event(piece, [k + 1], n_out=k + 1, done=k == len(pieces) - 1))
    if not pieces:
        out.append(event(done=True))
    return out


def states(tokenizer, n=1, tools=None):
    parser = (lambda: HermesJsonToolParser(tools)) if tools else (lambda: None)
    return [ChoiceProgress(i, OutputSplitter(QWEN, parser())) for i in range(n)]


def run_stream(tokenizer, events, tools=None, **opts) -> list[dict]:
    options = {"want_logprobs": False, "include_usage": False, "timings_per_token": False, "return_progress": False}
    options.update(opts)
    choices = states(tokenizer, tools=tools)
    stream = ChunkStream("id", 0, "m", choices, tokenizer, **options)

    async def source():
        for e in events:
            yield choices[0].feed(e)

    async def collect():
        return [json.loads(p) async for p in chunks(stream, source())]

    return asyncio.run(collect())


def run_aggregate(tokenizer, events, tools=None, logprobs=False) -> dict:
    (state,) = states(tokenizer, tools=tools)
    builder = MessageBuilder(logprobs)
    for e in events:
        builder.add(state.feed(e).deltas, wire_logprobs(tokenizer, e.logprobs))
    return json.loads(msgspec.json.encode(completion("id", 0, "m", [state], [builder])))


def concat(chunks_: list[dict]) -> dict:
    """Stream chunks folded into the aggregate message shape."""
    msg = {"content": "", "reasoning_content": "", "tool_calls": {}}
    finish = None
    for c in chunks_:
        for ch in c["choices"]:
            d = ch["delta"]
            msg["content"] += d.get("content") or ""
            msg["reasoning_content"] += d.get("reasoning_content") or ""
            for call in d.get("tool_calls") or []:
                entry = msg["tool_calls"].setdefault(call["index"], {"id": None, "name": None, "arguments": ""})
                entry["id"] = call.get("id", entry["id"])
                entry["name"] = call.get("function", {}).get("name", entry["name"])
                entry["arguments"] += call["function"].get("arguments", "")
            finish = ch["finish_reason"] or finish
    return {**msg, "finish_reason": finish}


def test_reasoning_answer_and_tool_call_stream_equal_the_aggregate(tokenizer):
    text = "<think>\nhmm, weather\n</think>\n\nSure." + "\n" + CALL
    pieces = [text[i:i + 3] for i in range(0, len(text), 3)]
    stream = run_stream(tokenizer, crafted(pieces), tools=[WEATHER])
    assert stream[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    kinds = [set(c["choices"][0]["delta"]) for c in stream if c["choices"]]
    assert all(len(k) <= 2 for k in kinds)  # reasoning and content never share a chunk
    folded = concat(stream)
    assert folded["reasoning_content"] == "hmm, weather" and folded["content"] == "Sure."
    (call,) = folded["tool_calls"].values()
    assert call["name"] == "get_weather" and call["id"].startswith("call_")
    assert call["arguments"] == '{"city": "Paris", "unit": "c"}'  # the model's member order
    assert folded["finish_reason"] == "tool_calls"

    agg = run_aggregate(tokenizer, crafted(pieces), tools=[WEATHER])
    message = agg["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == ("hmm, weather", "Sure.")
    assert [c["function"] for c in message["tool_calls"]] == [{"name": "get_weather", "arguments": call["arguments"]}]
    assert agg["choices"][0]["finish_reason"] == "tool_calls" and message["refusal"] is None
    assert agg["usage"]["completion_tokens_details"]["reasoning_tokens"] > 0


def test_parallel_calls_are_indexed_in_order(tokenizer):
    second = CALL.replace("Paris", "Rome")
    folded = concat(run_stream(tokenizer, crafted([CALL, "\n", second]), tools=[WEATHER]))
    assert [c["arguments"] for c in folded["tool_calls"].values()] == [
        '{"city": "Paris", "unit": "c"}', '{"city": "Rome", "unit": "c"}']
    assert len({c["id"] for c in folded["tool_calls"].values()}) == 2


@pytest.mark.parametrize("bad", [
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": }}\n</tool_call>',
    '<tool_call>\n{"name": "undeclared", "arguments": {}}\n</tool_call>',
    CALL + " trailing words",
])
def test_malformed_tool_markup_falls_back_to_text_byte_exactly(tokenizer, bad):
    pieces = [bad[i:i + 5] for i in range(0, len(bad), 5)]
    folded = concat(run_stream(tokenizer, crafted(pieces), tools=[WEATHER]))
    assert folded["content"] == bad and not folded["tool_calls"] and folded["finish_reason"] == "stop"
    assert run_aggregate(tokenizer, crafted(pieces), tools=[WEATHER])["choices"][0]["message"]["content"] == bad


def test_usage_and_timings_chunk_ordering(tokenizer):
    events = crafted(["a", "b", "c"], prompt=12, cached=4)
    plain = run_stream(tokenizer, events)
    assert "timings" in plain[-1] and plain[-1]["choices"][0]["finish_reason"] == "stop"
    assert all("timings" not in c for c in plain[:-1])
    with_usage = run_stream(tokenizer, crafted(["a", "b", "c"]), include_usage=True)
    last = with_usage[-1]
    assert last["choices"] == [] and last["usage"]["prompt_tokens"] == 12
    assert last["usage"]["prompt_tokens_details"] == {"cached_tokens": 4}
    t = last["timings"]
    assert t["cache_n"] + t["prompt_n"] == 12 and t["predicted_n"] == 3
    assert t["prompt_ms"] == pytest.approx(500.0) and t["predicted_ms"] == pytest.approx(500.0)
    assert t["predicted_per_second"] == pytest.approx(4.0)  # two intervals in half a second
    assert all(c["usage"] is None for c in with_usage[:-1])


def test_zero_output_timings_are_finite_zeros(tokenizer):
    agg = run_aggregate(tokenizer, crafted([], finish="length"))
    t = agg["timings"]
    assert t["predicted_n"] == 0 and t["predicted_per_second"] == 0 and t["predicted_per_token_ms"] == 0
    assert all(math.isfinite(v) for v in t.values())
    assert agg["choices"][0]["message"]["content"] == "" and agg["choices"][0]["finish_reason"] == "length"


def test_return_progress_precedes_output_and_never_moves_back(tokenizer):
    stream = run_stream(tokenizer, crafted(["x", "y"], prompt=12, cached=4), return_progress=True)
    progress = [i for i, c in enumerate(stream) if "prompt_progress" in c]
    first_delta = next(i for i, c in enumerate(stream) if c["choices"] and c["choices"][0]["delta"].get("content"))
    values = [stream[i]["prompt_progress"] for i in progress]
    assert progress[-1] < first_delta and stream[0]["choices"][0]["delta"]["role"] == "assistant"
    assert values[0]["processed"] == values[0]["cache"] == 4 and values[-1]["processed"] == values[-1]["total"] == 12
    assert [v["processed"] for v in values] == sorted({v["processed"] for v in values})


def test_timings_per_token_and_logprobs_ride_on_visible_chunks(tokenizer):
    stream = run_stream(tokenizer, crafted(["x", "y", "z"], logprobs=True), timings_per_token=True,
                        want_logprobs=True)
    content = [c for c in stream if c["choices"] and c["choices"][0]["delta"].get("content")]
    assert content and all("timings" in c for c in content)
    entries = [e for c in stream if c["choices"] for e in (c["choices"][0]["logprobs"] or {}).get("content") or []]
    assert len(entries) == 3 and entries[0]["top_logprobs"] == [{"token": "x", "logprob": -0.5, "bytes": [120]}]


# -- prompt options -----------------------------------------------------------------------

EFFORT_TEMPLATE = (
    "{%- set effort = reasoning_effort | default('medium') -%}"
    "{%- for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor -%}"
    "{%- if enable_thinking is defined and not enable_thinking %}[no-think]"
    "{%- elif effort == 'low' %}[low]{% elif effort == 'medium' %}[medium]{% elif effort == 'xhigh' %}[xhigh]"
    "{%- endif %}"
)


def chat_request(**fields):
    return msgspec.convert({"messages": [{"role": "user", "content": "hi"}], **fields}, ChatCompletionRequest)


@pytest.fixture(scope="module")
def effort_pipeline():
    return tokenizer_pipeline(Tokenizer(build_tokenizer(), templates={"default": EFFORT_TEMPLATE}))


@pytest.mark.parametrize(("fields", "suffix", "thinking"), [
    ({}, "[medium]", True),
    ({"reasoning_effort": "low"}, "[low]", True),
    ({"reasoning_effort": "xhigh", "enable_thinking": True}, "[xhigh]", True),
    ({"reasoning_effort": "none"}, "[no-think]", False),
    ({"chat_template_kwargs": {"enable_thinking": False}}, "[no-think]", False),
])
def test_effort_and_thinking_reach_the_template(effort_pipeline, fields, suffix, thinking):
    rendered = effort_pipeline.render(chat_prompt(chat_request(**fields)))
    assert rendered.text == "<user>hi" + suffix and rendered.options.thinking is thinking
    assert rendered.token_ids == effort_pipeline.tokenizer.encode(rendered.text)


@pytest.mark.parametrize(("fields", "param", "code"), [
    ({"reasoning_effort": "high"}, "reasoning_effort", "reasoning_effort_not_supported"),
    ({"reasoning_effort": "extreme"}, "reasoning_effort", "invalid_request"),
    ({"reasoning_effort": "low", "enable_thinking": False}, "reasoning_effort", "conflicting_template_option"),
    ({"enable_thinking": True, "chat_template_kwargs": {"enable_thinking": False}}, "enable_thinking",
     "conflicting_template_option"),
    ({"preserve_thinking": True}, "preserve_thinking", "unsupported_parameter"),  # the template cannot
])
def test_prompt_option_errors(effort_pipeline, fields, param, code):
    with pytest.raises(InvalidRequestError) as e:
        effort_pipeline.render(chat_prompt(chat_request(**fields)))
    assert (e.value.param, e.value.code) == (param, code)


def test_server_defaults_apply_when_the_request_is_silent():
    caps = detect_caps(TINY_TEMPLATE)
    options = resolve_options(template_options(chat_request()), caps, thinking_default=False, preserve_default=True)
    assert (options.thinking, options.preserve_thinking, options.effort) == (False, True, None)
    switchless = detect_caps("{{ messages }}")  # no switch: the server default decides either way
    assert resolve_options(template_options(chat_request(enable_thinking=False)), switchless, True, False).thinking
    assert not resolve_options(template_options(chat_request(enable_thinking=True)), switchless, False, False).thinking


def test_sampling_params_from_the_request():
    params = sampling_params(chat_request(max_completion_tokens=7, max_tokens=3, stop="x", logprobs=True,
                                          top_logprobs=2, logit_bias={"5": 0, "6": -3.5}, seed=-1, top_k=0), 512)
    assert (params.max_tokens, params.stop, params.logprobs, params.seed, params.top_k) == (7, ["x"], 2, -1, 0)
    assert params.logit_bias == {6: -3.5}  # zero biases are neutral and dropped
    assert sampling_params(chat_request(logprobs=False, top_logprobs=0), 512).logprobs is None


# -- parser selection -----------------------------------------------------------------------


@pytest.mark.parametrize(("prompt", "inside"), [
    ("<|im_start|>assistant\n<think>\n", True),  # the template opened the reasoning block
    ("<|im_start|>assistant\n<think>\n\n</think>\n\n", False),  # thinking switched off
    ("<|im_start|>assistant\n<think>\nold\n</think>\n\nx<|im_end|>\n<|im_start|>assistant\n", False),
])
def test_starts_in_reasoning_follows_the_prompt(prompt, inside):
    assert starts_in_reasoning(prompt, QWEN) is inside
    assert starts_in_reasoning(prompt, None) is False


@pytest.mark.parametrize(("chosen", "text", "calls"), [
    (None, CALL, 1),  # the family's default: hermes_json
    ("qwen3_xml", "<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n</function>\n"
                  "</tool_call>", 1),
    ("qwen3_xml", CALL, 0),  # JSON markup means nothing to the XML parser: it stays text
])
def test_tool_parser_comes_from_the_profile_or_the_family(chosen, text, calls):
    state = SimpleNamespace(profile=Profile(tools=Tools(parser=chosen)), registry=load_registry(),
                            family=SimpleNamespace(reasoning_parser="qwen3", tool_parser="hermes_json"))
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER.parameters}}]
    split = make_splitter(state, "<|im_start|>assistant\n", tools)
    deltas = split.feed(text) + split.finish()
    assert sum(isinstance(d, ToolCallStart) for d in deltas) == calls
    assert not any(isinstance(d, ToolCallStart) for d in make_splitter(state, "", []).feed(text))
