"""Forced tools and structured output through Anthropic Messages, with the anthropic SDK.

The server reads tool calls in the qwen3_xml format here (the Chat tests cover
hermes_json), so the grammar of that format is exercised end to end on the tiny model:
whatever the random model writes inside a forced call, the parser reads back a
``tool_use`` block whose input follows the schema.
"""

from __future__ import annotations

import json

import anthropic
import jsonschema
import pytest
from server_harness import server_fixture

server = server_fixture("--max-context", "1024", "--protocols", "anthropic_messages", "--tool-parser", "qwen3_xml",
                        "--max-concurrency", "2", "--log-stats-interval-ms", "0")
MODEL = "claude-local"
USER = [{"role": "user", "content": "Wake me up."}]
ALARM = {"type": "object", "properties": {"loud": {"type": "boolean"}, "hour": {"type": "integer", "minimum": 5,
                                                                                 "maximum": 9}},
         "required": ["hour"], "additionalProperties": False}
NOTE = {"type": "object", "properties": {"tag": {"type": "string", "enum": ["home", "work"]}}, "required": ["tag"]}
TOOLS = [{"name": "set_alarm", "input_schema": ALARM, "strict": True},
         {"name": "note", "description": "file a note", "input_schema": NOTE, "strict": True}]
SCHEMAS = {"set_alarm": ALARM, "note": NOTE}
NO_THINKING = {"type": "disabled"}
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def client(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server, api_key="unused", max_retries=0)


def create(client, **kw):
    """Greedy (this SDK takes temperature only as an extra), so each run sees the same output."""
    return client.messages.create(**{"model": MODEL, "messages": USER, "max_tokens": 96, "thinking": NO_THINKING,
                                     "extra_body": GREEDY, **kw})


def tool_uses(message, names=tuple(SCHEMAS)) -> list:
    assert message.stop_reason == "tool_use"
    uses = [b for b in message.content if b.type == "tool_use"]
    assert uses and all(b.type == "tool_use" for b in message.content)
    for block in uses:
        assert block.name in names and block.id.startswith("toolu_")
        jsonschema.validate(block.input, SCHEMAS[block.name])
    return uses


def test_any_and_named_tool_choices_call_valid_tools(client):
    single = {"type": "any", "disable_parallel_tool_use": True}
    assert len(tool_uses(create(client, tools=TOOLS, tool_choice=single))) == 1
    named = create(client, tools=TOOLS, tool_choice={"type": "tool", "name": "note"}, max_tokens=240)
    tool_uses(named, names=("note",))  # parallel calls allowed: room for several


def test_a_streamed_forced_call_builds_the_same_input(client):
    choice = {"type": "tool", "name": "set_alarm", "disable_parallel_tool_use": True}
    with client.messages.stream(model=MODEL, messages=USER, max_tokens=96, thinking=NO_THINKING, tools=TOOLS,
                                tool_choice=choice, extra_body=GREEDY) as stream:
        events = list(stream)
        message = stream.get_final_message()
    (use,) = tool_uses(message, names=("set_alarm",))
    partial = "".join(e.delta.partial_json for e in events
                      if e.type == "content_block_delta" and e.delta.type == "input_json_delta")
    assert json.loads(partial) == use.input


def test_structured_output_answers_validate(client):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                               "maximum": 9}},
              "required": ["ok", "n"], "additionalProperties": False}
    message = create(client, output_config={"format": {"type": "json_schema", "schema": schema}}, max_tokens=32)
    assert message.stop_reason == "end_turn" and [b.type for b in message.content] == ["text"]
    jsonschema.validate(json.loads(message.content[0].text), schema)


@pytest.mark.parametrize("kw, field", [
    ({"tools": [{**TOOLS[0], "input_schema": {"type": "object", "properties": {"x": {"type": "string",
                                                                                      "pattern": "^a"}}}}]},
     "tools[0].input_schema"),  # a pattern on raw parameter text: the qwen3_xml format cannot enforce it
    ({"tools": [{**TOOLS[0], "input_schema": {"type": "object", "properties": {"x": {"type": "strin"}}}}]},
     "tools[0].input_schema"),
    ({"output_config": {"format": {"type": "json_schema", "schema": {"type": "objekt"}}}},
     "output_config.format.schema"),
    ({"tools": TOOLS, "tool_choice": {"type": "tool", "name": "alarm"}}, "tool_choice.name"),
])
def test_invalid_constraints_are_400s_naming_the_field(client, kw, field):
    with pytest.raises(anthropic.BadRequestError) as info:
        create(client, **kw)
    error = info.value.body["error"]
    assert error["type"] == "invalid_request_error" and field in error["message"], error
