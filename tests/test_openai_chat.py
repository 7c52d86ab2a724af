"""POST /v1/chat/completions against a real ``ninfer-serve`` process, through the openai SDK.

One module-scoped server on the tiny model; the renderers' handling of reasoning and
tool markup the random model rarely writes is in tests/test_openai_chat_render.py.
"""

from __future__ import annotations

import json
import math

import httpx
import msgspec
import openai
import pytest
from server_harness import server_fixture

from ninfer.tiny.tokenizer_files import build_tokenizer
from ninfer.tokenizer import Tokenizer

server = server_fixture("--max-context", "512", "--prefill-chunk", "16", "--max-concurrency", "2")
MODEL = "tiny:qwen3"
MESSAGES = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Name three rivers."}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "weather now",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}},
         {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}]


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer(build_tokenizer())  # the tiny checkpoint's tokenizer, built the same way


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)


def chat(client, **kw):
    return client.chat.completions.create(**{"model": MODEL, "messages": MESSAGES, "max_tokens": 12, **kw})


def raw_stream(server, body: dict) -> tuple[httpx.Response, list]:
    """POST a streaming request; returns the response and its data payloads (JSON or "[DONE]")."""
    with httpx.stream("POST", f"{server}/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES,
                                                                      "stream": True, **body}, timeout=60) as r:
        lines = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    return r, [line if line == "[DONE]" else json.loads(line) for line in lines]


def test_stream_deltas_concatenate_to_the_aggregate(client):
    agg = chat(client, seed=7, max_tokens=24)
    chunks_ = list(chat(client, seed=7, max_tokens=24, stream=True, stream_options={"include_usage": True}))
    assert chunks_[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks_ if c.choices)
    reasoning = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks_ if c.choices)
    message = agg.choices[0].message
    assert text == (message.content or "") and reasoning == (getattr(message, "reasoning_content", None) or "")
    usage = chunks_[-1].usage  # the same except for cached tokens: the second request reuses the first's pages
    assert chunks_[-1].choices == [] and (usage.prompt_tokens, usage.completion_tokens) == (
        agg.usage.prompt_tokens, agg.usage.completion_tokens)
    finish = [c.choices[0].finish_reason for c in chunks_ if c.choices and c.choices[0].finish_reason]
    assert finish == [agg.choices[0].finish_reason]
    assert agg.model == MODEL and agg.object == "chat.completion" and message.refusal is None


def test_raw_stream_framing_usage_and_timings(server):
    r, payloads = raw_stream(server, {"max_tokens": 6, "stream_options": {"include_usage": True}})
    assert r.status_code == 200 and r.headers["x-request-id"] and r.headers["content-type"].startswith(
        "text/event-stream")
    assert payloads[-1] == "[DONE]"
    last = payloads[-2]
    assert last["choices"] == [] and "timings" in last and "usage" in last
    assert all("timings" not in p for p in payloads[:-2])
    usage, t = last["usage"], last["timings"]
    assert usage["completion_tokens_details"]["reasoning_tokens"] >= 0
    assert t["cache_n"] + t["prompt_n"] == usage["prompt_tokens"] == usage["prompt_tokens_details"]["cached_tokens"] \
        + t["prompt_n"]
    _, plain = raw_stream(server, {"max_tokens": 4})
    assert plain[-1] == "[DONE]" and plain[-2]["choices"][0]["finish_reason"] and "timings" in plain[-2]


def test_usage_and_timings_invariants_with_prefix_reuse(server):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x " * 60}], "max_tokens": 5}
    first = httpx.post(f"{server}/v1/chat/completions", json=body, timeout=60).json()
    again = httpx.post(f"{server}/v1/chat/completions", json=body, timeout=60).json()
    for result in (first, again):
        u, t = result["usage"], result["timings"]
        assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
        assert t["cache_n"] == u["prompt_tokens_details"]["cached_tokens"]
        assert t["cache_n"] + t["prompt_n"] == u["prompt_tokens"] and t["predicted_n"] == u["completion_tokens"]
        assert all(math.isfinite(v) and v >= 0 for v in t.values())
    assert again["timings"]["cache_n"] > 0  # the repeated prompt reused cached pages


def test_return_progress_with_a_real_prefill(server):
    body = {"messages": [{"role": "user", "content": "long prompt " * 20}], "max_tokens": 3, "return_progress": True,
            "timings_per_token": True}
    _, payloads = raw_stream(server, body)
    progress = [i for i, p in enumerate(payloads) if isinstance(p, dict) and "prompt_progress" in p]
    deltas = [i for i, p in enumerate(payloads) if isinstance(p, dict) and p["choices"]
              and p["choices"][0]["delta"].get("content")]
    values = [payloads[i]["prompt_progress"] for i in progress]
    assert len(values) >= 3  # initial, at least one prefill chunk, final
    assert values[0]["processed"] == values[0]["cache"] and values[-1]["processed"] == values[-1]["total"]
    assert [v["processed"] for v in values] == sorted(v["processed"] for v in values)
    assert not deltas or progress[-1] < deltas[0]
    assert all("timings" in payloads[i] for i in deltas)


def test_reasoning_split_end_to_end(client, tokenizer):
    think = tokenizer.token_to_id("<think>")
    forced = chat(client, max_tokens=5, logit_bias={str(think): 100}, seed=1)
    message = forced.choices[0].message
    assert message.reasoning_content == "<think>" * 4 and not message.content
    assert forced.usage.completion_tokens_details.reasoning_tokens == 5
    streamed = list(chat(client, max_tokens=5, logit_bias={str(think): 100}, seed=1, stream=True))
    assert "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in streamed if c.choices) \
        == "<think>" * 4
    on = chat(client, max_tokens=1, extra_body={"enable_thinking": True})
    off = chat(client, max_tokens=1, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    closed_block = len(tokenizer.encode("<think>\n\n</think>\n\n"))
    assert off.usage.prompt_tokens == on.usage.prompt_tokens + closed_block
    effort_none = chat(client, max_tokens=1, reasoning_effort="none")
    assert effort_none.usage.prompt_tokens == off.usage.prompt_tokens


def test_preserve_thinking_keeps_earlier_reasoning(client):
    history = [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1", "reasoning_content": "r " * 10},
               {"role": "user", "content": "q2"}]
    kept = chat(client, messages=history, max_tokens=1, extra_body={"preserve_thinking": True})
    dropped = chat(client, messages=history, max_tokens=1, extra_body={"chat_template_kwargs": {"preserve_thinking": False}})
    assert kept.usage.prompt_tokens > dropped.usage.prompt_tokens


def test_tool_history_renders_and_tool_choice_filters(client):
    history = MESSAGES + [
        {"role": "assistant", "content": None, "reasoning": "need data",
         "tool_calls": [{"id": "call_1", "type": "function",
                         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
                        {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": {}}}]},
        {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "noon"}]},
    ]
    both = chat(client, messages=history, tools=TOOLS, tool_choice="auto", max_tokens=4)
    assert both.choices[0].finish_reason in ("stop", "length", "tool_calls")
    one = chat(client, messages=history, tools=TOOLS, max_tokens=1, tool_choice={
        "type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": [{"type": "function",
                                                                               "function": {"name": "get_time"}}]}})
    none = chat(client, messages=history, tools=TOOLS, tool_choice="none", max_tokens=1)
    bare = chat(client, messages=history, max_tokens=1)
    assert both.usage.prompt_tokens > one.usage.prompt_tokens > none.usage.prompt_tokens == bare.usage.prompt_tokens


def test_logprobs_shape(client):
    result = chat(client, logprobs=True, top_logprobs=3, max_tokens=6)
    entries = result.choices[0].logprobs.content
    assert len(entries) == result.usage.completion_tokens
    for e in entries:
        assert isinstance(e.token, str) and e.logprob <= 0 and isinstance(e.bytes, list)
        assert len(e.top_logprobs) == 3
        assert [t.logprob for t in e.top_logprobs] == sorted((t.logprob for t in e.top_logprobs), reverse=True)
    assert chat(client, max_tokens=2).choices[0].logprobs is None


def test_n_choices_have_their_own_seeds(client):
    result = chat(client, n=3, seed=11, max_tokens=8, logprobs=True)
    assert [c.index for c in result.choices] == [0, 1, 2]
    assert len({c.message.content for c in result.choices}) > 1
    assert result.usage.completion_tokens == sum(len(c.logprobs.content) for c in result.choices)
    streamed = list(chat(client, n=3, seed=11, max_tokens=8, stream=True))
    for c in result.choices:
        text = "".join(x.choices[0].delta.content or "" for x in streamed if x.choices and x.choices[0].index == c.index)
        assert text == c.message.content


def test_zero_max_tokens_processes_the_prompt_only(client):
    result = chat(client, max_completion_tokens=0)
    assert result.usage.completion_tokens == 0 and result.choices[0].finish_reason == "length"
    assert result.choices[0].message.content == ""
    timings = result.model_extra["timings"]
    assert timings["predicted_n"] == 0 and timings["prompt_n"] + timings["cache_n"] == result.usage.prompt_tokens


@pytest.mark.parametrize(("kwargs", "param", "code"), [
    ({"response_format": {"type": "yaml"}}, "response_format.type", "invalid_request"),
    ({"extra_body": {"guided_regex": ""}}, "guided_regex", "invalid_request"),
    ({"extra_body": {"structured_outputs": {"choice": []}}}, "structured_outputs.choice", "invalid_request"),
    ({"modalities": ["text", "audio"]}, "modalities", "unsupported_parameter"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_date"}}},
     "tool_choice.function.name", "invalid_request"),
    ({"tool_choice": "required"}, "tool_choice", "invalid_request"),  # nothing to call
    ({"web_search_options": {}}, "web_search_options", "unsupported_parameter"),
    ({"verbosity": "low"}, "verbosity", "unsupported_parameter"),
    ({"store": True}, "store", "unsupported_parameter"),
    ({"functions": [{"name": "f"}]}, "functions", "unsupported_parameter"),
    ({"extra_body": {"repetition_penalty": 1.2}}, "repetition_penalty", "unsupported_parameter"),
    ({"extra_body": {"chat_template_kwargs": {"tokenize": True}}}, "chat_template_kwargs.tokenize",
     "unsupported_parameter"),
    ({"reasoning_effort": "high"}, "reasoning_effort", "reasoning_effort_not_supported"),
    ({"reasoning_effort": "none", "extra_body": {"enable_thinking": True}}, "reasoning_effort",
     "conflicting_template_option"),
    ({"extra_body": {"preserve_thinking": True, "chat_template_kwargs": {"preserve_thinking": False}}},
     "preserve_thinking", "conflicting_template_option"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop", "invalid_request"),
    ({"stop": [""]}, "stop", "invalid_request"),
    ({"temperature": 2.5}, "temperature", "invalid_request"),
    ({"extra_body": {"top_k": 21}}, "top_k", "invalid_request"),
    ({"extra_body": {"min_p": 1.5}}, "min_p", "invalid_request"),
    ({"top_logprobs": 21, "logprobs": True}, "top_logprobs", "invalid_request"),
    ({"logit_bias": {"5": 101}}, "logit_bias", "invalid_request"),
    ({"logit_bias": {"999999": 1}}, "logit_bias", "invalid_request"),
    ({"max_tokens": -1}, "max_tokens", "invalid_request"),
    # JSON types are strict: no string-to-number, float-to-int or number-to-bool coercion
    ({"max_tokens": "5"}, "max_tokens", "invalid_request"),
    ({"max_completion_tokens": 5.0}, "max_completion_tokens", "invalid_request"),
    ({"temperature": "0.5"}, "temperature", "invalid_request"),
    ({"extra_body": {"stream": "true"}}, "stream", "invalid_request"),
    ({"logprobs": 1}, "logprobs", "invalid_request"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content", "invalid_request"),
    ({"messages": [{"content": "hi"}]}, "messages[0].role", "invalid_request"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://x/a.png"}}]}]},
     "messages[0].content[0]", "vision_disabled"),
    ({"messages": [{"role": "user", "content": "hi", "name": "bob"}]}, "messages[0].name", "unsupported_parameter"),
    ({"messages": [{"role": "user", "content": "long " * 600}]}, "messages", "context_length_exceeded"),
    ({"max_tokens": 600}, "max_tokens", "context_length_exceeded"),
    ({"tools": [{"type": "function", "function": {"name": "get weather"}}]}, "tools[0].function.name",
     "invalid_request"),  # under tool_choice auto too: no call can carry the name
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "x", "prompt_cache_breakpoint": {
        "mode": "bogus"}}]}]}, "messages[0].content[0].prompt_cache_breakpoint", "invalid_request"),
    ({"extra_body": {"prompt_cache_options": {"mode": "bogus"}}}, "prompt_cache_options.mode", "invalid_request"),
    ({"extra_body": {"prompt_cache_options": {"ttl": "99y"}}}, "prompt_cache_options.ttl", "invalid_request"),
    ({"extra_body": {"prompt_cache_retention": "forever"}}, "prompt_cache_retention", "invalid_request"),
    # argument JSON no decoder or tokenizer can take (these were 500s)
    ({"messages": [*MESSAGES, {"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {
        "name": "get_time", "arguments": "[" * 1000 + "]" * 1000}}]}, {"role": "tool", "tool_call_id": "c",
        "content": "r"}]}, "messages[2].tool_calls[0].function.arguments", "invalid_request"),
    ({"messages": [*MESSAGES, {"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {
        "name": "get_time", "arguments": '{"zone": "\\ud800"}'}}]}, {"role": "tool", "tool_call_id": "c",
        "content": "r"}]}, "messages[2].tool_calls[0].function.arguments", "invalid_request"),
])
def test_rejections_name_their_field(client, kwargs, param, code):
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, **kwargs)
    error = e.value.body
    assert e.value.status_code == 400 and (error["param"], error["code"]) == (param, code), error
    assert error["type"] == "invalid_request_error" and error["message"]


def test_a_body_nested_past_the_decoders_limit_is_a_400(server):
    deep = '{"a":' * 1000 + "{}" + "}" * 1000
    body = '{"model": "%s", "max_tokens": 1, "messages": %s, "metadata": %s}' % (MODEL, json.dumps(MESSAGES), deep)
    r = httpx.post(f"{server}/v1/chat/completions", content=body, headers={"content-type": "application/json"},
                   timeout=60)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text


def test_prompt_cache_breakpoints_become_shared_prefix_candidates():
    """Marked messages end explicit candidates (latest four, the implicit one taking a slot);
    a tool result that renders inside one message with the next has no boundary of its own."""
    from ninfer_plugins.protocols.openai_chat.schema import ChatCompletionRequest
    from ninfer_plugins.protocols.openai_chat.translate import chat_prompt

    def marked(role, **kw):
        return {"role": role, **kw, "content": [{"type": "text", "text": role,
                                                 "prompt_cache_breakpoint": {"mode": "explicit"}}]}

    def prompt(messages, mode=None):
        body = {"model": MODEL, "messages": messages, **({"prompt_cache_options": {"mode": mode}} if mode else {})}
        return chat_prompt(msgspec.json.decode(json.dumps(body), type=ChatCompletionRequest))

    call = {"role": "assistant", "tool_calls": [{"id": c, "type": "function", "function": {"name": "f"}}
                                                for c in ("a", "b")]}
    messages = [marked("system"), marked("user"), call, marked("tool", tool_call_id="a"),
                marked("tool", tool_call_id="b"), {"role": "user", "content": "q"}]
    explicit = prompt(messages, "explicit")
    assert (explicit.cache_breakpoints, explicit.implicit_breakpoint) == ((1, 2, 5), None)
    implicit = prompt(messages)
    assert (implicit.cache_breakpoints, implicit.implicit_breakpoint) == ((1, 2, 5), 6)
    many = [marked("user" if i % 2 == 0 else "assistant") for i in range(6)]
    assert prompt(many, "explicit").cache_breakpoints == (3, 4, 5, 6)
    assert prompt(many, "implicit").cache_breakpoints == (3, 4, 5, 6)  # the implicit target is one of them
    assert prompt(many[:-1] + [{"role": "assistant", "content": "a"}]).cache_breakpoints == (3, 4, 5)


def test_neutral_values_are_accepted(client):
    result = chat(client, max_tokens=2, logit_bias={"5": 0}, logprobs=False, top_logprobs=0, verbosity="medium",
                  response_format={"type": "text"}, modalities=["text"], store=False, parallel_tool_calls=True,
                  metadata={"k": "v"}, user="u", service_tier="auto", prompt_cache_key="p", seed=-3,
                  prediction={"type": "content", "content": "x"}, safety_identifier="s",
                  extra_body={"repetition_penalty": 1, "mm_processor_kwargs": {"fps": None}, "functions": [],
                              "function_call": "none", "chat_template_kwargs": {"enable_thinking": None},
                              "some_unknown_field": {"x": 1}, "prompt_cache_options": {"mode": "implicit"}})
    assert result.choices[0].logprobs is None and result.usage.completion_tokens == 2


def test_a_missing_body_field_is_named(server):
    r = httpx.post(f"{server}/v1/chat/completions", json={"model": MODEL, "max_tokens": 1}, timeout=60)
    assert r.status_code == 400 and (r.json()["error"]["param"], r.json()["error"]["code"]) == (
        "messages", "invalid_request")
    whole = httpx.post(f"{server}/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 1, "temperature": 1},
                       timeout=60)
    assert whole.status_code == 200, whole.text  # an integer is a fine float


def test_model_field(server, client):
    with pytest.raises(openai.NotFoundError) as e:
        chat(client, model="some-other-model")
    assert (e.value.body["code"], e.value.body["param"]) == ("model_not_found", "model")
    assert e.value.response.headers["x-request-id"]
    for body in ({}, {"model": ""}, {"model": None}):
        r = httpx.post(f"{server}/v1/chat/completions", json={**body, "messages": MESSAGES, "max_tokens": 1}, timeout=60)
        assert r.status_code == 200 and r.json()["model"] == MODEL


def _early_stop_seed(create) -> int:
    """A seed whose sample ends on its own (end of turn or end of sequence) well before max_tokens."""
    for seed in range(40):
        r = create(seed=seed)
        if r.choices[0].finish_reason == "stop" and r.usage.completion_tokens < 30:
            return seed
    pytest.skip("the tiny model never stopped early")


def test_min_tokens_and_ignore_eos_from_extra_body_are_honoured(client):
    """vLLM's extensions, as its clients send them; they used to be dropped as unknown fields."""
    def create(**kw):
        return chat(client, max_tokens=60, **kw)

    seed = _early_stop_seed(create)
    ignored = create(seed=seed, extra_body={"ignore_eos": True})
    assert ignored.choices[0].finish_reason == "length" and ignored.usage.completion_tokens == 60
    held = create(seed=seed, extra_body={"min_tokens": 40})
    assert held.usage.completion_tokens > 40, held.usage
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, max_tokens=5, extra_body={"min_tokens": 6})
    assert e.value.body["param"] == "min_tokens"


def test_stop_token_ids_from_extra_body_end_the_output(client):
    """vLLM's stop_token_ids: a token the bias forces at every step ends the output at once;
    min_tokens holds it off (the sampler bans it) for that many tokens."""
    forced = {"logit_bias": {"100": 100}, "temperature": 0}
    first = chat(client, max_tokens=20, extra_body={"stop_token_ids": [100]}, **forced)
    assert first.choices[0].finish_reason == "stop" and first.usage.completion_tokens == 1, first.usage
    held = chat(client, max_tokens=20, extra_body={"stop_token_ids": [100], "min_tokens": 5}, **forced)
    assert held.choices[0].finish_reason == "stop" and held.usage.completion_tokens == 6, held.usage
    free = chat(client, max_tokens=8, **forced)  # without the field the forced token is ordinary output
    assert free.choices[0].finish_reason == "length" and free.usage.completion_tokens == 8
