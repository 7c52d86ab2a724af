"""The qwen3_xml and hermes_json tool-call parsers and the schema typing rules."""

from __future__ import annotations

import json

import pytest
from _split_helpers import assert_stream_equals_oneshot, run_chunks, timeline

from ninfer.capabilities import ToolParser
from ninfer.frontend.tool_schema import Conversion, ToolSpec, convert_parameter, schema_types
from ninfer.plugins import PluginRegistry
from ninfer_plugins.tool_parsers import hermes_json, qwen3_xml

WEATHER = ToolSpec(
    "get_weather",
    {
        "type": "object",
        "properties": {
            "city": {"type": "string"},
            "days": {"type": "integer"},
            "metric": {"type": "boolean"},
            "tags": {"type": "array"},
            "note": {"anyOf": [{"type": "string"}, {"type": "null"}]},
        },
    },
)
WRITE = ToolSpec(
    "write_file", {"type": "object", "properties": {"path": {"type": "string"}, "content": {"type": "string"}}}
)
TOOLS = [WEATHER, WRITE]


def xml_call(name: str, *params: tuple[str, str]) -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params)
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def json_call(name: str, arguments: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'


def xml(tolerant: bool = False):
    return lambda: qwen3_xml.Qwen3XmlToolParser(TOOLS, tolerant=tolerant)


def hermes(tolerant: bool = False):
    return lambda: hermes_json.HermesJsonToolParser(TOOLS, tolerant=tolerant)


def parse(make, text: str):
    parser = make()
    deltas = parser.feed(text) + parser.finish()
    return timeline(deltas), parser.stats


# -- typing rules ------------------------------------------------------------------


@pytest.mark.parametrize(
    "schema, raw, value, how",
    [
        ({"type": "string"}, "42", "42", Conversion.OK),
        ({"type": "string"}, "", "", Conversion.OK),
        ({"type": ["integer", "string"]}, "7", "7", Conversion.OK),
        ({"anyOf": [{"type": "string"}, {"type": "null"}]}, "null", "null", Conversion.OK),
        ({"type": "integer"}, "42", 42, Conversion.OK),
        ({"type": "integer"}, "", None, Conversion.OMITTED),
        ({"type": "object"}, " \n", None, Conversion.OMITTED),
        ({"type": "integer"}, "4.0", 4.0, Conversion.OK),
        ({"type": "integer"}, "4.5", 4.5, Conversion.MISMATCH),
        ({"type": "integer"}, "four", "four", Conversion.MISMATCH),
        ({"type": "integer"}, '"4"', "4", Conversion.MISMATCH),
        ({"type": "number"}, "1e3", 1000.0, Conversion.OK),
        ({"type": "number"}, "NaN", "NaN", Conversion.MISMATCH),
        ({"type": "number"}, "1e999", "1e999", Conversion.MISMATCH),
        ({"type": "boolean"}, "TRUE", True, Conversion.OK),
        ({"type": "boolean"}, " False ", False, Conversion.OK),
        ({"type": "boolean"}, "yes", "yes", Conversion.MISMATCH),
        ({"type": "boolean"}, "1", 1, Conversion.MISMATCH),
        ({"type": "null"}, "null", None, Conversion.OK),
        ({"type": "array"}, '[1, "a"]', [1, "a"], Conversion.OK),
        ({"type": "object"}, "[1]", [1], Conversion.MISMATCH),
        ({"anyOf": [{"type": "integer"}, {"type": "null"}]}, "null", None, Conversion.OK),
        ({"oneOf": [{"type": "integer"}, {"type": "boolean"}]}, "True", True, Conversion.OK),
        # no supported explicit type: untyped inference (JSON when it parses)
        ({}, "7", 7, Conversion.OK),
        ({}, "hello", "hello", Conversion.OK),
        ({}, "", "", Conversion.OK),
        ({"type": "decimal"}, "[1]", [1], Conversion.OK),
        ({"anyOf": [{"type": "integer"}, {"$ref": "#/x"}]}, "true", True, Conversion.OK),
    ],
)
def test_typing_rules(schema, raw, value, how):
    got, got_how = convert_parameter(raw, schema_types(schema))
    assert got_how is how
    if how is not Conversion.OMITTED:
        assert got == value and type(got) is type(value)


def test_object_values_keep_member_order():
    value, how = convert_parameter('{"z": 1, "a": {"y": 2, "b": 3}}', frozenset({"object"}))
    assert how is Conversion.OK and json.dumps(value) == '{"z": 1, "a": {"y": 2, "b": 3}}'


def test_parameter_types_come_from_the_top_level_property():
    assert WEATHER.parameter_types("days") == {"integer"}
    assert WEATHER.parameter_types("note") == {"string", "null"}
    assert WEATHER.parameter_types("undeclared") is None
    assert ToolSpec("t").parameter_types("x") is None


# -- qwen3_xml -----------------------------------------------------------------------


def test_xml_call_is_typed_by_schema_and_counts_diagnostics():
    text = "Checking.\n\n" + xml_call(
        "get_weather",
        ("tags", '["a", "b"]'),
        ("city", "Paris"),
        ("days", ""),
        ("metric", "TRUE"),
        ("extra", "12"),
        ("note", ""),
    )
    events, stats = parse(xml(), text)
    assert events == [
        ("text", "Checking."),
        ("call", "get_weather", '{"tags": ["a", "b"], "city": "Paris", "metric": true, "extra": 12, "note": ""}'),
    ]
    assert stats.as_dict() == {
        "marker_seen": True, "calls": 1, "omitted_empty_args": 1, "mismatched_args": 0, "fallback_reason": "none",
    }
    _, stats = parse(xml(), xml_call("get_weather", ("days", "soon"), ("metric", "7")))
    assert stats.mismatched_args == 2 and stats.calls == 1


def test_xml_call_without_parameters():
    events, _ = parse(xml(), "<tool_call>\n<function=get_weather>\n</function>\n</tool_call>")
    assert events == [("call", "get_weather", "{}")]


def test_xml_only_one_layout_newline_is_stripped():
    content = "\n\n  indented\n\n"
    events, _ = parse(xml(), xml_call("write_file", ("content", content)))
    assert json.loads(events[0][2]) == {"content": content}


def test_xml_parallel_calls_keep_order_and_get_distinct_ids():
    text = xml_call("get_weather", ("city", "Oslo")) + "\n" + xml_call("write_file", ("path", "a"), ("content", "b"))
    parser = qwen3_xml.Qwen3XmlToolParser(TOOLS)
    deltas = parser.feed(text) + parser.finish()
    assert timeline(deltas) == [
        ("call", "get_weather", '{"city": "Oslo"}'),
        ("call", "write_file", '{"path": "a", "content": "b"}'),
    ]
    assert parser.stats.calls == 2


def test_xml_string_values_keep_nested_parameter_text_and_markers():
    value = "x <parameter=a>\ninner\n</parameter> </function></tool_call><tool_call> y"
    events, stats = parse(xml(), xml_call("write_file", ("content", value)))
    assert json.loads(events[0][2]) == {"content": value} and stats.fallback_reason == "none"


@pytest.mark.parametrize(
    "text, reason",
    [
        (xml_call("get_weather", ("city", "a <parameter=b> c")), "malformed_structure"),  # unmatched opener
        (xml_call("get_weather", ("city", "a </parameter> c")), "malformed_structure"),  # stray closer
        (xml_call("get_weather", ("city", "a"), ("city", "b")), "duplicate_parameter"),
        (xml_call("get_time", ("zone", "UTC")), "undeclared_tool"),
        (xml_call("get weather", ("city", "a")), "invalid_tool_name"),
        (xml_call("get_weather", ("city", "a")) + "\nDone.", "trailing_content"),
        (xml_call("get_weather", ("city", "a")) + "\n<tool_call>\n<oops>", "malformed_structure"),
        (xml_call("get_weather", ("city", "a"))[: -len("</tool_call>")], "malformed_structure"),
        ("See <tool_call> tags.", "malformed_structure"),
        ("<tool_call>\n<function=get_weather>\n<parameter=city>\nPar", "malformed_structure"),  # truncated
    ],
)
def test_xml_fallback_returns_every_byte_as_text(text, reason):
    events = assert_stream_equals_oneshot(xml(), text)
    assert events == [("text", text)]
    assert parse(xml(), text)[1].fallback_reason == reason


def test_xml_fallback_keeps_scanning_for_a_later_call():
    text = "Use <tool_call> like so:\n" + xml_call("get_weather", ("city", "Rome"))
    events, stats = parse(xml(), text)
    assert events == [("text", "Use <tool_call> like so:"), ("call", "get_weather", '{"city": "Rome"}')]
    assert stats.fallback_reason == "malformed_structure" and stats.calls == 1


def test_tolerant_mode_recovers_complete_calls():
    call = xml_call("get_weather", ("city", "a"))
    events, stats = parse(xml(tolerant=True), call + "\nDone.")
    assert events == [("call", "get_weather", '{"city": "a"}'), ("text", "Done.")]
    assert stats.fallback_reason == "none"
    unwrapped = call[: -len("</tool_call>")]
    assert parse(xml(tolerant=True), unwrapped)[0] == [("call", "get_weather", '{"city": "a"}')]
    no_function_end = call.replace("</function>\n", "")
    assert parse(xml(tolerant=True), no_function_end)[0] == [("call", "get_weather", '{"city": "a"}')]
    bad_second = call + "\n<tool_call>\n<oops>"
    events, stats = parse(xml(tolerant=True), bad_second)
    # the separator belongs to the region that failed, so it comes back with it
    assert events == [("call", "get_weather", '{"city": "a"}'), ("text", "\n<tool_call>\n<oops>")]
    assert stats.fallback_reason == "malformed_structure"


def test_tolerant_mode_releases_a_call_before_the_output_ends():
    parser = qwen3_xml.Qwen3XmlToolParser(TOOLS, tolerant=True)
    assert [e[0] for e in timeline(parser.feed(xml_call("get_weather", ("city", "a")) + "\n"))] == ["call"]
    strict = qwen3_xml.Qwen3XmlToolParser(TOOLS)
    assert strict.feed(xml_call("get_weather", ("city", "a")) + "\n") == []
    assert [e[0] for e in timeline(strict.finish())] == ["call"]


XML_SAMPLES = [
    "Plain answer with < and <tool and <tool_cal but no call.",
    "Let me look.\n\n" + xml_call("get_weather", ("city", "Paris"), ("days", "3")) + "\n",
    xml_call("get_weather", ("city", "Zürich ✓")) + "\n" + xml_call("write_file", ("path", "x"), ("content", "<p>")),
    "Use <tool_call> then\n<tool_call>\n<function=nope>\n" + xml_call("write_file", ("content", "a\n</parameter>")),
    xml_call("write_file", ("content", "<parameter=q>\n1\n</parameter>")) + " trailing",
]


@pytest.mark.parametrize("tolerant", [False, True])
@pytest.mark.parametrize("text", XML_SAMPLES)
def test_xml_streaming_equals_one_shot(text, tolerant):
    events = assert_stream_equals_oneshot(xml(tolerant), text)
    calls = [e for e in events if e[0] == "call"]
    if not calls:  # every byte that is not a call is text, so plain fallbacks are exact
        assert "".join(e[1] for e in events) == text


# -- hermes_json ---------------------------------------------------------------------


def test_hermes_call_keeps_member_order_and_types():
    args = '{"tags": [1, {"z": 0, "a": null}], "city": "Köln", "days": 2.5}'
    events, stats = parse(hermes(), "Sure.\n" + json_call("get_weather", args) + "\n")
    assert events == [("text", "Sure."), ("call", "get_weather", args)]
    assert stats.calls == 1 and stats.fallback_reason == "none"


def test_hermes_parallel_calls_and_missing_arguments():
    text = json_call("get_weather", '{"city": "A"}') + "\n" + '<tool_call>\n{"name": "write_file"}\n</tool_call>'
    events, _ = parse(hermes(), text)
    assert events == [("call", "get_weather", '{"city": "A"}'), ("call", "write_file", "{}")]


def test_the_state_machine_takes_other_markers_without_a_closing_one():
    """A ``[TOOL_CALLS]``-style format (an opening marker only) is the base parser with
    other markers: each call ends where its JSON object does."""

    class Bracketed(hermes_json.HermesJsonToolParser):
        open_marker, close_marker = "[TOOL_CALLS]", None

    text = 'Let me look. [TOOL_CALLS]{"name": "get_weather", "arguments": {"city": "Oslo"}}' \
           '[TOOL_CALLS]{"name": "write_file", "arguments": {"path": "a"}}'
    for make in (lambda: Bracketed(TOOLS), lambda: Bracketed(TOOLS, tolerant=True)):
        events, stats = parse(make, text)
        assert events == [("text", "Let me look."), ("call", "get_weather", '{"city": "Oslo"}'),
                          ("call", "write_file", '{"path": "a"}')]
        assert stats.calls == 2
        assert_stream_equals_oneshot(make, text)
    # strict: text after a call still returns the region to text, every byte in place
    events, stats = parse(lambda: Bracketed(TOOLS), text + " done")
    assert events == [("text", text + " done")] and stats.fallback_reason == "trailing_content"
    # markers may also be given per instance
    parser = hermes_json.HermesJsonToolParser(TOOLS, open_marker="<|python_tag|>", close_marker=None)
    deltas = parser.feed('<|python_tag|>{"name": "write_file", "arguments": {}}') + parser.finish()
    assert timeline(deltas) == [("call", "write_file", "{}")]


def test_a_parser_must_name_its_markers():
    class Unnamed(hermes_json.HermesJsonToolParser):
        open_marker = ""

    with pytest.raises(TypeError, match="open_marker"):
        Unnamed(TOOLS)


@pytest.mark.parametrize(
    "text, reason",
    [
        (json_call("get_time", "{}"), "undeclared_tool"),
        (json_call("get weather", "{}"), "invalid_tool_name"),
        (json_call("get_weather", '{"city": "a", "city": "b"}'), "duplicate_parameter"),
        (json_call("get_weather", "[1]"), "malformed_structure"),
        (json_call("get_weather", '{"x": NaN}'), "malformed_structure"),
        ('<tool_call>\n{"name": "get_weather", "arguments": {}, "id": 1}\n</tool_call>', "malformed_structure"),
        (json_call("get_weather", "{}") + " and more", "trailing_content"),
        ("The <tool_call> tag wraps {JSON}.", "malformed_structure"),
        ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "line\nbreak"}}', "malformed_structure"),
        ('<tool_call>{"name": "get_weather", "arguments": {"a": [1}}</tool_call>', "malformed_structure"),
    ],
)
def test_hermes_fallback_returns_every_byte_as_text(text, reason):
    events = assert_stream_equals_oneshot(hermes(), text)
    assert events == [("text", text)]
    assert parse(hermes(), text)[1].fallback_reason == reason


HERMES_SAMPLES = [
    'Text {"name": 1} <tool_cal',
    "I'll call it.\n\n" + json_call("get_weather", '{"city": "Pa\\"ris}", "n": [1, 2]}'),
    json_call("get_weather", "{}") + "\n" + json_call("write_file", '{"content": "</tool_call>"}') + "\n",
    "<tool_call> nope " + json_call("get_weather", '{"a": {"b": {}}}') + " tail",
]


@pytest.mark.parametrize("tolerant", [False, True])
@pytest.mark.parametrize("text", HERMES_SAMPLES)
def test_hermes_streaming_equals_one_shot(text, tolerant):
    assert_stream_equals_oneshot(hermes(tolerant), text)


PROSE = "more prose " * 300


@pytest.mark.parametrize(
    "make, text",
    [
        (xml(), "You can emit <tool_call> blocks, or <tool_call>\n<function=f> " + PROSE),
        (xml(), "<tool_call>\n<function=search " + PROSE),
        (xml(), "<tool_call>\n<function=get_weather>\nno parameter here " + PROSE),
        (hermes(), "You can emit <tool_call> blocks, {like this} " + PROSE),
        (hermes(), '<tool_call>\n{"name": "f", "arguments": {"q": "open\n' + PROSE),
        (hermes(), "<tool_call>\n{ name: " + PROSE),
    ],
)
def test_prose_marker_is_released_long_before_the_end(make, text):
    """Held text stays bounded when a mentioned marker is not followed by a call."""
    parser = make()
    fed = emitted = worst = 0
    for ch in text:
        fed += 1
        emitted += sum(len(d.text) for d in parser.feed(ch))
        worst = max(worst, fed - emitted)
    assert worst <= 64
    assert emitted + sum(len(d.text) for d in parser.finish()) == len(text)


def test_no_tools_declared_means_every_call_is_text():
    text = xml_call("get_weather", ("city", "a"))
    events, stats = parse(lambda: qwen3_xml.Qwen3XmlToolParser([]), text)
    assert events == [("text", text)] and stats.fallback_reason == "undeclared_tool"


@pytest.mark.parametrize("module, name", [(qwen3_xml, "qwen3_xml"), (hermes_json, "hermes_json")])
def test_parsers_register_as_plugins(module, name):
    registry = PluginRegistry()
    registry.register_plugin(module, name=name)
    desc = registry.get("tool_parser", name)
    assert isinstance(desc, ToolParser) and desc.name == name
    parser = desc.factory(TOOLS, tolerant=False)
    call = xml_call("get_weather", ("city", "a")) if name == "qwen3_xml" else json_call("get_weather", '{"city": "a"}')
    assert timeline(run_chunks(lambda: parser, [call])) == [("call", "get_weather", '{"city": "a"}')]


def test_a_marker_only_format_gets_its_grammar_from_the_shared_builder(tok):
    """The grammar for a ``[TOOL_CALLS]`` format, built by ``build_grammar`` with its own
    markers, accepts what its parser reads as two calls (CONTRIBUTING.md's walk-through has
    its own copy-able tests in test_walkthrough_tool_parser.py)."""
    from ninfer_plugins.guided.llguidance_backend import LLGuidanceCompiler
    from ninfer.frontend.tool_grammar import CallMarkers, build_grammar, embedded_json, json_call_schema

    # the tiny tokenizer has no [TOOL_CALLS] token, so the marker is spelled out as text
    markers = CallMarkers(open='"[TOOL_CALLS]"', close=None, spelled="[TOOL_CALLS]")
    body = lambda tool, rule: f"{rule}: {embedded_json(json_call_schema(tool))}"  # noqa: E731
    guide = build_grammar([WRITE], "required", body, markers=markers)
    text = '[TOOL_CALLS]{"name": "write_file", "arguments": {"path": "a"}}' \
           '[TOOL_CALLS]{"name": "write_file", "arguments": {}}'
    matcher = LLGuidanceCompiler(tok, tok.vocab_size).matcher(guide)
    ids = tok.encode(text)
    assert matcher.try_consume_tokens(ids) == len(ids)
    assert not matcher.try_consume_tokens(tok.encode(" and some prose"))  # calls only

    class Bracketed(hermes_json.HermesJsonToolParser):
        open_marker, close_marker = "[TOOL_CALLS]", None

    events, _ = parse(lambda: Bracketed(TOOLS), text)
    assert events == [("call", "write_file", '{"path": "a"}'), ("call", "write_file", "{}")]


def test_strict_tool_schemas_read_their_patterns_as_ecma_does(tok):
    """Tool parameters' JSON Schema patterns are ECMA-262 like every other pattern: in a
    forced call of a strict tool, ``\\s`` is ECMA's white space, not Unicode's."""
    from ninfer.errors import InvalidRequestError
    from ninfer_plugins.guided.llguidance_backend import LLGuidanceCompiler
    from ninfer_plugins.tool_parsers.hermes_json_grammar import hermes_grammar

    def tool(pattern: str) -> ToolSpec:
        return ToolSpec("code", {"type": "object", "properties": {"c": {"type": "string", "pattern": pattern}},
                                 "required": ["c"], "additionalProperties": False}, strict=True,
                        param="tools[0].function.parameters")

    compiler = LLGuidanceCompiler(tok, tok.vocab_size)

    def accepts(guide, c: str) -> bool:
        ids = tok.encode(f'<tool_call>\n{{"name": "code", "arguments": {{"c": "{c}"}}}}\n</tool_call>')
        m = compiler.matcher(guide)
        return m.try_consume_tokens(ids) == len(ids)

    guide = hermes_grammar([tool(r"^\d\s\d$")], "required")
    assert accepts(guide, "1\u00a02") and not accepts(guide, "1\u00852") and not accepts(guide, "١ 2")
    with pytest.raises(InvalidRequestError) as err:
        hermes_grammar([tool("[a-")], "required")
    assert err.value.param == "tools[0].function.parameters"
