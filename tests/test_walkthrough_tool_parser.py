"""CONTRIBUTING.md's tool-call parser, as a plugin package would test it: copy this file.

It imports only ninfer's public modules (docs/plugins.md lists them) and pytest. The
parser, its grammar and its registration below are the walk-through's code, verbatim
(the last test checks that), for calls written after a ``[TOOL_CALLS]`` marker::

    Let me check. [TOOL_CALLS]{"name": "get_weather", "arguments": {"city": "Oslo"}}
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from ninfer.frontend.output_split import TextDelta, ToolCallArgs, ToolCallEnd, ToolCallStart
from ninfer.frontend.tool_schema import ToolSpec
from ninfer.plugins import PluginRegistry, load_registry

# -- the walk-through's code ------------------------------------------------------------

from ninfer.frontend.json_call import JsonCallBody
from ninfer.frontend.tool_regions import TaggedToolParser


class BracketCalls(TaggedToolParser):
    """Calls after a ``[TOOL_CALLS]`` marker, each one JSON object with name and arguments."""

    open_marker = "[TOOL_CALLS]"
    close_marker = None  # a call ends where its JSON object does

    def new_body(self, start):  # start: where the call's body begins in the parser's buffer
        return JsonCallBody(self.tools, self.tolerant, start)


from ninfer.frontend.tool_grammar import CallMarkers, build_grammar, check_name, embedded_json, json_call_schema

# '"[TOOL_CALLS]"' is the marker as text; write <[TOOL_CALLS]> if the tokenizer holds it as one special token
MARKERS = CallMarkers(open='"[TOOL_CALLS]"', close=None, spelled="[TOOL_CALLS]")


def bracket_body(tool, rule):
    check_name(tool.name, tool.param)  # a name the parser could not read back cannot be forced
    return f"{rule}: {embedded_json(json_call_schema(tool))}"


def bracket_grammar(tools, mode, *, parallel=True, answer=None):
    return build_grammar(tools, mode, bracket_body, parallel=parallel, answer=answer, markers=MARKERS)


from ninfer.capabilities import ToolParser
from ninfer.hookspecs import hookimpl


@hookimpl
def register_tool_parsers(register):
    register(ToolParser(name="bracket_calls", description="[TOOL_CALLS]{...} tool calls",
                        factory=BracketCalls, grammar=bracket_grammar))


# -- the tests ----------------------------------------------------------------------------

WEATHER = ToolSpec("get_weather", {"type": "object", "properties": {"city": {"type": "string"}}})
TOOLS = [WEATHER]
TEXT = 'Let me check. [TOOL_CALLS]{"name": "get_weather", "arguments": {"city": "Oslo"}}'


def outcome(deltas) -> list[tuple]:
    """``("text", ...)`` and ``("call", name, arguments)`` in order, neighbouring text merged."""
    out: list[tuple] = []
    names: dict[int, str] = {}
    for d in deltas:
        if isinstance(d, TextDelta) and out and out[-1][0] == "text":
            out[-1] = ("text", out[-1][1] + d.text)
        elif isinstance(d, TextDelta) and d.text:
            out.append(("text", d.text))
        elif isinstance(d, ToolCallStart):
            names[d.index] = d.name
        elif isinstance(d, ToolCallEnd):
            out.append(("call", names[d.index], d.arguments))
    return out


def run(parser, *chunks: str) -> list:
    deltas = []
    for chunk in chunks:
        deltas += parser.feed(chunk)
    return deltas + parser.finish()


def test_the_plugin_registers_and_is_selected_by_name():
    registry = PluginRegistry()
    registry.register_plugin(sys.modules[__name__], name="bracket_calls")
    plugin = registry.get("tool_parser", "bracket_calls", key="tools.parser")
    assert plugin.factory is BracketCalls and plugin.grammar is bracket_grammar


@pytest.mark.parametrize("tolerant", [False, True])
def test_calls_are_split_from_the_text(tolerant):
    two = TEXT + ' [TOOL_CALLS]{"name": "get_weather", "arguments": {}}'
    assert outcome(run(BracketCalls(TOOLS, tolerant=tolerant), two)) == [
        ("text", "Let me check."), ("call", "get_weather", '{"city": "Oslo"}'), ("call", "get_weather", "{}")]


@pytest.mark.parametrize("tolerant", [False, True])
def test_where_the_chunks_fall_never_changes_the_result(tolerant):
    whole = outcome(run(BracketCalls(TOOLS, tolerant=tolerant), TEXT))
    for k in range(len(TEXT) + 1):
        assert outcome(run(BracketCalls(TOOLS, tolerant=tolerant), TEXT[:k], TEXT[k:])) == whole, k
    assert outcome(run(BracketCalls(TOOLS, tolerant=tolerant), *TEXT)) == whole  # one character at a time


@pytest.mark.parametrize("text, reason", [
    ('[TOOL_CALLS]{"name": "get_time", "arguments": {}}', "undeclared_tool"),
    ('[TOOL_CALLS]{"name": "get_weather", "arguments": {"city": }}', "malformed_structure"),
    ('[TOOL_CALLS]{"name": "get_weather", "arguments": {}} and then prose', "trailing_content"),
    ("a [TOOL_CALLS] marker in prose", "malformed_structure"),
])
def test_malformed_markup_comes_back_as_text_byte_for_byte(text, reason):
    parser = BracketCalls(TOOLS)
    assert outcome(run(parser, text)) == [("text", text)]
    assert parser.stats.fallback_reason == reason


def test_tolerant_mode_streams_the_arguments_while_they_are_written():
    parser = BracketCalls(TOOLS, tolerant=True)
    cut = TEXT.index("Oslo")
    early = parser.feed(TEXT[:cut])  # the city's value is still to be written
    assert [type(d) for d in early if not isinstance(d, TextDelta)][:1] == [ToolCallStart]
    assert "".join(d.fragment for d in early if isinstance(d, ToolCallArgs)) == '{"city": "'
    assert outcome(early + run(parser, TEXT[cut:])) == outcome(run(BracketCalls(TOOLS), TEXT))


@pytest.fixture(scope="module")
def guides(tmp_path_factory):
    """The installed guided-decoding backend over a small tokenizer (use your model's)."""
    from ninfer.tiny.tokenizer_files import write_tokenizer_files
    from ninfer.tokenizer import Tokenizer

    folder = tmp_path_factory.mktemp("tokenizer")
    write_tokenizer_files(folder)
    tokenizer = Tokenizer.from_pretrained(folder)
    backend = load_registry().get("guided_decoding", "llguidance", key="guided.backend")
    return tokenizer, backend.factory(tokenizer, tokenizer.vocab_size)


def test_the_grammar_forces_calls_the_parser_reads(guides):
    tokenizer, compiler = guides
    calls = '[TOOL_CALLS]{"name": "get_weather", "arguments": {"city": "Oslo"}}'
    matcher = compiler.matcher(bracket_grammar(TOOLS, "required"))
    ids = tokenizer.encode(calls)
    assert matcher.validate_tokens(ids) == len(ids)
    assert all(matcher.consume_token(i) for i in ids)
    assert matcher.validate_tokens(tokenizer.encode(" and some prose")) == 0  # "required": calls only
    assert outcome(run(BracketCalls(TOOLS), calls)) == [("call", "get_weather", '{"city": "Oslo"}')]


def test_contributing_shows_this_code():
    """Every Python block of CONTRIBUTING.md's walk-through is in this file, verbatim."""
    guide = (Path(__file__).resolve().parents[1] / "CONTRIBUTING.md").read_text()
    section = guide[guide.index("## Writing a tool-call parser"):]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    source = Path(__file__).read_text()
    assert len(blocks) >= 3
    for block in blocks:
        assert block.strip() in source, block
