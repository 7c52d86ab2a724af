"""Structured output and forced function calls through the Responses API, with the openai SDK.

The tiny model writes noise, so a message that parses as JSON valid for the schema, or
a function_call Item whose arguments validate, was shaped by the grammar.
"""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from server_harness import server_fixture

server = server_fixture("--max-context", "1024", "--protocols", "openai_responses", "--log-stats-interval-ms", "0")
MODEL = "tiny:qwen3"
NO_THINKING = {"effort": "none"}
ANSWER = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                           "maximum": 9}},
          "required": ["ok", "n"], "additionalProperties": False}
LOOKUP = {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 99}},
          "required": ["id"], "additionalProperties": False}
TOOLS = [{"type": "function", "name": "lookup", "parameters": LOOKUP, "strict": True},
         {"type": "namespace", "name": "crm", "description": "customer records",
          "tools": [{"type": "function", "name": "lookup", "parameters": LOOKUP, "strict": True}]}]


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)


def create(client, **kw):
    return client.responses.create(**{"model": MODEL, "input": "Find customer 7.", "max_output_tokens": 64,
                                      "reasoning": NO_THINKING, "temperature": 0, **kw})


def calls(response) -> list:
    assert response.status == "completed"
    items = [i for i in response.output if i.type == "function_call"]
    assert items and all(i.type == "function_call" for i in response.output)
    for item in items:
        jsonschema.validate(json.loads(item.arguments), LOOKUP)
    return items


def test_text_format_json_schema_and_json_object(client):
    fmt = {"type": "json_schema", "name": "answer", "schema": ANSWER, "strict": True}
    response = create(client, text={"format": fmt})
    assert response.status == "completed" and response.text.format.type == "json_schema"
    jsonschema.validate(json.loads(response.output_text), ANSWER)
    obj = create(client, text={"format": {"type": "json_object"}}, max_output_tokens=24)
    assert obj.output_text.startswith("{")  # an open-ended object may outrun the budget


def test_required_and_named_choices_make_valid_calls(client):
    (single,) = calls(create(client, tools=TOOLS, tool_choice="required", parallel_tool_calls=False))
    assert single.name == "lookup"
    named = calls(create(client, tools=TOOLS, tool_choice={"type": "function", "namespace": "crm", "name": "lookup"},
                         max_output_tokens=200))
    assert all((i.namespace, i.name) == ("crm", "lookup") for i in named)


def test_a_streamed_forced_call(client):
    events = list(create(client, tools=TOOLS, tool_choice={"type": "function", "name": "lookup"},
                         parallel_tool_calls=False, stream=True))
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    (item,) = calls(events[-1].response)
    assert [e.arguments for e in done] == [item.arguments]


@pytest.mark.parametrize("kw, param", [
    ({"text": {"format": {"type": "json_schema", "name": "a", "schema": {"type": "objekt"}}}}, "text.format.schema"),
    ({"tools": [{**TOOLS[0], "parameters": {"type": "object", "properties": {"id": {"minimum": "one"}}}}]},
     "tools[0].parameters"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "namespace": "erp", "name": "lookup"}}, "tool_choice.name"),
])
def test_invalid_constraints_are_400s_naming_the_field(client, kw, param):
    with pytest.raises(openai.BadRequestError) as info:
        create(client, **kw)
    assert info.value.body["param"] == param, info.value.body
