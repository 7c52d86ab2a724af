"""Tool-call arguments stream incrementally from a real server with --tolerant-tool-calls.

The tiny model writes noise, so ``tool_choice: required`` makes the grammar write the
call (the tool parser's own wire format); the strict schema below has a free string, so
its value arrives over several tokens and must reach the client in several deltas.
"""

from __future__ import annotations

import json

import anthropic
import openai
import pytest
from server_harness import server_fixture

FLAGS = ("--max-context", "1024", "--tolerant-tool-calls", "--max-concurrency", "2", "--log-stats-interval-ms", "0")
xml_server = server_fixture(*FLAGS, "--tool-parser", "qwen3_xml")
hermes_server = server_fixture(*FLAGS, "--tool-parser", "hermes_json")

NOTE = {"type": "object", "properties": {"title": {"type": "string", "maxLength": 12},
                                         "pages": {"type": "integer", "minimum": 1, "maximum": 9}},
        "required": ["title", "pages"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "save_note", "parameters": NOTE, "strict": True}}]
MESSAGES = [{"role": "user", "content": "Save a note."}]
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


@pytest.fixture(scope="module", params=["xml_server", "hermes_server"])
def server(request) -> str:
    return request.getfixturevalue(request.param)


def _create(server: str, **kw):
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)
    return client.chat.completions.create(model="tiny:qwen3", messages=MESSAGES, tools=TOOLS,
                                          tool_choice="required", parallel_tool_calls=False, extra_body=NO_THINKING, seed=7,
                                          temperature=1.0, **kw)


def test_chat_streams_arguments_in_pieces_that_add_up_to_the_aggregate(server):
    chunks = list(_create(server, max_tokens=200, stream=True))
    pieces = [c.function.arguments for ch in chunks if ch.choices for c in ch.choices[0].delta.tool_calls or []
              if c.function and c.function.arguments]
    assert len(pieces) >= 3, pieces  # really incremental, not one delta per call
    finish = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert finish == ["tool_calls"]
    streamed = json.loads("".join(pieces))
    assert set(streamed) == {"title", "pages"} and 1 <= streamed["pages"] <= 9
    whole = _create(server, max_tokens=200).choices[0]
    assert whole.finish_reason == "tool_calls"
    assert whole.message.tool_calls[0].function.arguments == "".join(pieces)  # same seed, same call


def test_a_call_cut_off_by_max_tokens_closes_with_valid_json(server):
    whole = _create(server, max_tokens=200)
    args = json.loads(whole.choices[0].message.tool_calls[0].function.arguments)
    # the same seed writes the same tokens: stop two tokens before the call's end
    chunks = list(_create(server, max_tokens=whole.usage.completion_tokens - 2, stream=True))
    choices = [ch.choices[0] for ch in chunks if ch.choices]
    pieces = [c.function.arguments or "" for ch in choices for c in ch.delta.tool_calls or [] if c.function]
    assert choices[-1].finish_reason == "length"
    cut = json.loads("".join(pieces))  # the committed call is closed, not left dangling
    assert isinstance(cut, dict) and all(args[k] == v or isinstance(v, str) for k, v in cut.items())


def test_anthropic_streams_input_json_in_pieces(server):
    client = anthropic.Anthropic(base_url=server, api_key="unused", max_retries=0)
    tools = [{"name": "save_note", "input_schema": NOTE, "strict": True}]
    with client.messages.stream(model="local", max_tokens=200, messages=MESSAGES, tools=tools,
                                tool_choice={"type": "any", "disable_parallel_tool_use": True},
                                thinking={"type": "disabled"}) as stream:
        events = list(stream)
        final = stream.get_final_message()
    partial = [e.delta.partial_json for e in events
               if e.type == "content_block_delta" and e.delta.type == "input_json_delta" and e.delta.partial_json]
    assert len(partial) >= 3
    uses = [b for b in final.content if b.type == "tool_use"]
    assert [u.input for u in uses] == [json.loads("".join(partial))]
