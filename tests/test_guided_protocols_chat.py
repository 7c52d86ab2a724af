"""Guided Chat Completions against a real ``ninfer-serve`` (tiny model), through the openai SDK.

The tiny model writes noise, so anything well-formed in its output was put there by
the grammar: JSON that validates, calls the tool parser reads back. Schemas are small
(enums, bounded integers, booleans) so a constrained answer ends within a few tokens;
requests that allow parallel calls get room for several. A logit bias can make a token
the model's every free choice: ``<tool_call>`` shows that a call the model opens on its
own is held to a strict schema; ``<think>``, with the server's thinking budget closing
the reasoning, shows the guide shaping the answer after it.
"""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest
from server_harness import server_fixture

from ninfer_plugins.reasoning.qwen3 import QWEN3
from ninfer.tiny.tokenizer_files import build_tokenizer

TOKENS = build_tokenizer()

BUDGET = 3
server = server_fixture("--max-context", "1024", "--default-thinking-budget", str(BUDGET), "--max-concurrency", "4",
                        "--protocols", "openai_chat", "--log-stats-interval-ms", "0")
MODEL = "tiny:qwen3"
MESSAGES = [{"role": "user", "content": "What is the weather?"}]
NO_THINKING = {"enable_thinking": False}
ANSWER = {"type": "object", "properties": {"sky": {"enum": ["clear", "cloudy"]},
                                           "temp": {"type": "integer", "minimum": -9, "maximum": 40}},
          "required": ["sky", "temp"], "additionalProperties": False}
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
ALARM = {"type": "object", "properties": {"loud": {"type": "boolean"}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER, "strict": True}},
         {"type": "function", "function": {"name": "set_alarm", "parameters": ALARM}}]
SCHEMAS = {"get_weather": WEATHER, "set_alarm": ALARM}


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)


def chat(client, **kw):
    kw.setdefault("extra_body", NO_THINKING)
    return client.chat.completions.create(**{"model": MODEL, "messages": MESSAGES, "max_tokens": 48, **kw})


def assert_valid_calls(choice, names=tuple(SCHEMAS)) -> list:
    calls = choice.message.tool_calls
    assert choice.finish_reason == "tool_calls" and calls and not choice.message.content
    for call in calls:
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    return calls


def test_json_schema_answers_validate(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "weather", "schema": ANSWER, "strict": True}}
    result = chat(client, response_format=fmt, n=4, seed=1)
    for choice in result.choices:
        assert choice.finish_reason == "stop" and not choice.message.tool_calls
        jsonschema.validate(json.loads(choice.message.content), ANSWER)
    stream = chat(client, response_format=fmt, seed=2, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    jsonschema.validate(json.loads(text), ANSWER)


def test_json_object_and_vllm_style_fields(client):
    obj = chat(client, response_format={"type": "json_object"}, max_tokens=32, seed=3).choices[0]
    if obj.finish_reason == "stop":
        assert isinstance(json.loads(obj.message.content), dict)
    else:  # free-form strings can outrun the budget, but the object is still what was started
        assert obj.finish_reason == "length" and obj.message.content.startswith("{")
    choice = chat(client, extra_body={**NO_THINKING, "guided_choice": ["north", "south"]}, n=3)
    assert {c.message.content for c in choice.choices} <= {"north", "south"}
    regex = chat(client, extra_body={**NO_THINKING, "structured_outputs": {"regex": "[0-9]{3}-[a-z]{2}"}})
    assert re.fullmatch("[0-9]{3}-[a-z]{2}", regex.choices[0].message.content)


def test_required_and_named_tool_choices_call_valid_tools(client):
    single = chat(client, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, n=3, seed=5, max_tokens=64)
    for choice in single.choices:
        assert len(assert_valid_calls(choice)) == 1
    named = chat(client, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "set_alarm"}},
                 seed=6, max_tokens=240)  # parallel calls allowed: room for several
    assert_valid_calls(named.choices[0], names=("set_alarm",))
    stream = list(chat(client, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}},
                       parallel_tool_calls=False, seed=8, max_tokens=64, stream=True))
    arguments = "".join(call.function.arguments or "" for c in stream if c.choices
                        for call in c.choices[0].delta.tool_calls or ())
    assert stream[-1].choices[0].finish_reason == "tool_calls"
    jsonschema.validate(json.loads(arguments), WEATHER)


def test_a_call_the_model_opens_in_auto_mode_follows_the_strict_schema(client):
    opens = {str(TOKENS.token_to_id("<tool_call>")): 100}
    result = chat(client, tools=TOOLS[:1], logit_bias=opens, parallel_tool_calls=False, n=2, seed=9, max_tokens=64)
    for choice in result.choices:
        assert_valid_calls(choice, names=("get_weather",))
    text = chat(client, tools=TOOLS, seed=10, max_tokens=8).choices[0]  # nothing forces a call
    assert text.finish_reason == "length" and text.message.content and not text.message.tool_calls


def test_with_thinking_the_guide_shapes_the_answer_after_the_reasoning(client):
    think = {str(TOKENS.token_to_id("<think>")): 100}
    close = QWEN3.budget_close
    fmt = {"type": "json_schema", "json_schema": {"name": "weather", "schema": ANSWER}}
    result = chat(client, response_format=fmt, logit_bias=think, max_tokens=96, temperature=0, extra_body={})
    message = result.choices[0].message
    assert message.reasoning_content == "<think>" * BUDGET + close.split("</think>")[0].rstrip("\n")
    jsonschema.validate(json.loads(message.content), ANSWER)
    called = chat(client, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "set_alarm"}},
                  parallel_tool_calls=False, logit_bias=think, max_tokens=128, temperature=0, extra_body={})
    assert called.choices[0].message.reasoning_content == message.reasoning_content
    assert_valid_calls(called.choices[0], names=("set_alarm",))


@pytest.mark.parametrize("kwargs, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}},
     "response_format.json_schema.schema"),
    ({"tools": [{"type": "function", "function": {"name": "f", "strict": True,
                                                  "parameters": {"type": "object", "required": 3}}}]},
     "tools[0].function.parameters"),
    ({"extra_body": {**NO_THINKING, "guided_regex": "(unclosed"}}, "guided_regex"),
    ({"extra_body": {**NO_THINKING, "guided_grammar": "root ::= ("}}, "guided_grammar"),
    ({"response_format": {"type": "json_object"}, "extra_body": {**NO_THINKING, "guided_choice": ["a"]}},
     "guided_choice"),  # two answer constraints
])
def test_invalid_constraints_are_400s_naming_the_field(client, kwargs, param):
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as info:
            result = chat(client, stream=stream, **kwargs)
            list(result) if stream else None
        assert info.value.body["param"] == param, info.value.body
