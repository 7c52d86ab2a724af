"""Request fields -> guides, per protocol, without a server (the grammar text is tested elsewhere)."""

from __future__ import annotations

import json

import msgspec
import pytest

from ninfer.capabilities import ToolParser
from ninfer.errors import InvalidRequestError, UnsupportedFeatureError
from ninfer.frontend.tool_schema import ToolSpec
from ninfer.guided.spec import GuideSpec
from ninfer_plugins.protocols.anthropic_messages.guided import answer_guide as anthropic_answer
from ninfer_plugins.protocols.anthropic_messages.schema import decode_request
from ninfer_plugins.protocols.anthropic_messages.tools import parse_tool_choice, template_tools, tool_request
from ninfer.frontend.pipeline import output_guide
from ninfer.sampling_params import SamplingParams
from ninfer_plugins.protocols.openai_chat.guided import answer_guide
from ninfer_plugins.protocols.openai_chat.schema import ChatCompletionRequest
from ninfer_plugins.protocols.openai_chat.translate import generate_request
from ninfer_plugins.protocols.openai_chat.validate import callable_tools, validate_request
from ninfer_plugins.protocols.openai_responses.guided import text_format_guide
from ninfer_plugins.protocols.openai_responses.schema import TextOptions
from ninfer_plugins.protocols.openai_responses.tools import resolve_tools
from ninfer.frontend.tool_guide import ToolRequest, request_guide

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
PARAMS = {"type": "object", "properties": {"city": {"type": "string"}}}
CHAT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": PARAMS, "strict": True}},
              {"type": "function", "function": {"name": "get_time"}}]


class Recorder:
    """A tool parser's ``grammar`` that records what it was asked for."""

    def __init__(self):
        self.calls: list[tuple] = []

    def __call__(self, tools, mode, *, parallel=True, answer=None):
        self.calls.append(([(t.name, t.strict, t.param) for t in tools], mode, parallel, answer))
        return GuideSpec("lark", "start: /x/", "tools")


@pytest.fixture
def recorder() -> Recorder:
    return Recorder()


@pytest.fixture
def parser(recorder) -> ToolParser:
    return ToolParser("fake", grammar=recorder)


def chat_req(**kw) -> ChatCompletionRequest:
    req = msgspec.convert({"messages": [{"role": "user", "content": "q"}], **kw}, ChatCompletionRequest)
    validate_request(req)
    return req


def chat_guide(req: ChatCompletionRequest, parser: ToolParser):
    """The guide the pipeline gives a chat request: the route's request, then the pipeline's guide."""
    return output_guide(generate_request(req, SamplingParams(), None), parser)


# -- Chat Completions ------------------------------------------------------------------------


@pytest.mark.parametrize("fields, expected", [
    ({"response_format": {"type": "text"}}, None),
    ({"response_format": {"type": "json_object"}}, GuideSpec("json_object", None, "response_format")),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA, "strict": True}}},
     GuideSpec("json_schema", SCHEMA, "response_format.json_schema.schema")),
    ({"guided_json": json.dumps(SCHEMA)}, GuideSpec("json_schema", SCHEMA, "guided_json")),
    ({"guided_regex": "[a-z]+"}, GuideSpec("regex", "[a-z]+", "guided_regex")),
    ({"guided_choice": ["yes", "no"]}, GuideSpec("choice", ["yes", "no"], "guided_choice")),
    ({"guided_grammar": 'root ::= "a"'}, GuideSpec("ebnf", 'root ::= "a"', "guided_grammar")),
    ({"grammar": 'root ::= "a"'}, GuideSpec("ebnf", 'root ::= "a"', "grammar")),
    ({"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}},
     GuideSpec("json_schema", SCHEMA, "structured_outputs.json")),
    ({"structured_outputs": {"json_object": True}}, GuideSpec("json_object", None, "structured_outputs.json_object")),
    ({"structured_outputs": {"structural_tag": '{"triggers": ["<f"]}'}},
     GuideSpec("structural_tag", {"triggers": ["<f"]}, "structured_outputs.structural_tag")),
])
def test_chat_answer_constraints(fields, expected):
    assert answer_guide(chat_req(**fields)) == expected


@pytest.mark.parametrize("fields, param", [
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": "{}"}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "regex"}}, "response_format.type"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_choice": ["a", 1]}, "guided_choice"),
    ({"structured_outputs": {"json_object": "yes"}}, "structured_outputs.json_object"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),  # two at once
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs.choice"),
])
def test_chat_answer_constraint_errors_name_the_field(fields, param):
    with pytest.raises(InvalidRequestError) as info:
        answer_guide(chat_req(**fields))
    assert info.value.param == param


def test_chat_tool_choices(parser, recorder):
    assert chat_guide(chat_req(tools=CHAT_TOOLS[1:]), parser) is None  # nothing to enforce: no grammar
    assert not recorder.calls
    chat_guide(chat_req(tools=CHAT_TOOLS), parser)  # a strict tool: calls are checked even in auto
    chat_guide(chat_req(tools=CHAT_TOOLS, tool_choice="required", parallel_tool_calls=False), parser)
    named = chat_req(tools=CHAT_TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}})
    chat_guide(named, parser)
    assert len(callable_tools(named)) == 2  # a named choice narrows the grammar, not the prompt
    chat_guide(chat_req(tools=CHAT_TOOLS, tool_choice={"type": "allowed_tools", "allowed_tools": {
        "mode": "required", "tools": [{"type": "function", "function": {"name": "get_weather"}}]}}), parser)
    schema = {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA}}
    chat_guide(chat_req(tools=CHAT_TOOLS[1:], response_format=schema), parser)
    strict = ("get_weather", True, "tools[0].function.parameters")
    loose = ("get_time", False, "tools[1].function.parameters")
    answer = GuideSpec("json_schema", SCHEMA, "response_format.json_schema.schema")
    assert recorder.calls == [
        ([strict, loose], "auto", True, None),
        ([strict, loose], "required", False, None),
        ([loose], "required", True, None),
        ([strict], "required", True, None),
        ([(*loose[:2], "tools[0].function.parameters")], "auto", True, answer),
    ]
    # tool_choice none: the format alone
    assert chat_guide(chat_req(tools=CHAT_TOOLS, tool_choice="none", response_format=schema), parser) == answer


def test_a_guide_the_tool_format_cannot_write_names_its_cause():
    plain = ToolParser("plain")  # no grammar
    tools = [ToolSpec("f", param="tools[0].function.parameters")]
    assert request_guide(ToolRequest(tools), None, plain) is None
    cases = [(ToolRequest(tools, forced=True), None, "tool_choice"),
             (ToolRequest(tools, parallel=False), None, "parallel_tool_calls"),
             (ToolRequest([ToolSpec("f", strict=True, param="tools[0].function.parameters")]), None,
              "tools[0].function.parameters"),
             (ToolRequest(tools), GuideSpec("json_object", None, "response_format"), "response_format")]
    for req, answer, param in cases:
        with pytest.raises(UnsupportedFeatureError) as info:
            request_guide(req, answer, plain)
        assert info.value.param == param and "plain" in info.value.message
    with pytest.raises(InvalidRequestError) as missing:
        request_guide(ToolRequest(forced=True, choice_param="tool_choice.type"), None, plain)
    assert missing.value.param == "tool_choice.type"


# -- Responses -------------------------------------------------------------------------------


def test_responses_tool_choices_and_formats():
    ns = {"type": "namespace", "name": "crm", "tools": [{"type": "function", "name": "lookup", "strict": True,
                                                          "parameters": PARAMS}]}
    direct = {"type": "function", "name": "lookup"}
    named = resolve_tools([direct, ns], {"type": "function", "namespace": "crm", "name": "lookup"}, False)
    assert len(named.definitions) == 2  # both stay in the prompt
    assert named.request == ToolRequest([ToolSpec("crm.lookup", PARAMS, True, "tools[1].tools[0].parameters")],
                                        forced=True, parallel=False)
    required = resolve_tools([direct, ns], {"type": "allowed_tools", "mode": "required",
                                            "tools": [{"type": "function", "name": "lookup"}]}, None)
    assert [s.name for s in required.request.tools] == ["lookup"] and required.request.forced
    assert not resolve_tools([direct], "auto", None).request.forced
    assert text_format_guide(TextOptions({"type": "text"})) is None
    assert text_format_guide(TextOptions({"type": "json_object"})) == GuideSpec("json_object", None, "text.format")
    fmt = {"type": "json_schema", "name": "n", "schema": SCHEMA, "strict": True}
    assert text_format_guide(TextOptions(fmt)) == GuideSpec("json_schema", SCHEMA, "text.format.schema")
    for bad, param in [({"type": "json_schema", "name": "n"}, "text.format.schema"),
                       ({"type": "grammar"}, "text.format.type")]:
        with pytest.raises(InvalidRequestError) as info:
            text_format_guide(TextOptions(bad))
        assert info.value.param == param


# -- Anthropic Messages ----------------------------------------------------------------------


def test_anthropic_tool_choices_and_output_format():
    tools = [{"name": "get_weather", "input_schema": PARAMS, "strict": True},
             {"name": "get_time", "input_schema": {"type": "object"}}]
    definitions = template_tools(tools)
    forced = tool_request(tools, definitions, parse_tool_choice({"type": "tool", "name": "get_time"}))
    assert forced == ToolRequest([ToolSpec("get_time", {"type": "object"}, False, "tools[1].input_schema")],
                                 forced=True, parallel=True, parallel_param="tool_choice.disable_parallel_tool_use")
    any_one = tool_request(tools, definitions, parse_tool_choice({"type": "any", "disable_parallel_tool_use": True}))
    assert any_one.forced and not any_one.parallel and [t.strict for t in any_one.tools] == [True, False]
    assert tool_request(tools, definitions, parse_tool_choice({"type": "none"})) == ToolRequest()
    with pytest.raises(InvalidRequestError) as info:
        tool_request(tools, definitions, parse_tool_choice({"type": "tool", "name": "nope"}))
    assert info.value.param == "tool_choice.name"

    def answer(**body):
        return anthropic_answer(decode_request(json.dumps({"model": "m", **body}).encode()))

    fmt = {"type": "json_schema", "schema": SCHEMA}
    assert answer(output_config={"format": fmt}) == GuideSpec("json_schema", SCHEMA, "output_config.format.schema")
    assert answer(output_format=fmt) == GuideSpec("json_schema", SCHEMA, "output_format.schema")
    assert answer(output_format=fmt, output_config={"format": fmt}) is not None  # the same twice is fine
    with pytest.raises(InvalidRequestError) as conflict:
        answer(output_format=fmt, output_config={"format": {**fmt, "schema": {"type": "string"}}})
    assert conflict.value.param == "output_format"
