"""OutputSplitter: reasoning / answer / tool-call separation, streamed and one-shot."""

from __future__ import annotations

import pytest
from _split_helpers import assert_stream_equals_oneshot, run_chunks, timeline

from ninfer_plugins.reasoning.qwen3 import QWEN3
from ninfer.frontend.output_split import OutputSplitter, ReasoningDelta, TextDelta
from ninfer.frontend.tool_schema import ToolSpec
from ninfer_plugins.tool_parsers.hermes_json import HermesJsonToolParser
from ninfer_plugins.tool_parsers.qwen3_xml import Qwen3XmlToolParser

QWEN = QWEN3
TOOLS = [ToolSpec("search", {"type": "object", "properties": {"q": {"type": "string"}, "n": {"type": "integer"}}})]
XML_CALL = (
    "<tool_call>\n<function=search>\n<parameter=q>\nwhy <b>\n</parameter>\n"
    "<parameter=n>\n2\n</parameter>\n</function>\n</tool_call>"
)


def splitter(starts_in_reasoning: bool = False, tools=None, reasoning=QWEN):
    return lambda: OutputSplitter(reasoning, tools() if tools else None, starts_in_reasoning)


def xml_tools():
    return Qwen3XmlToolParser(TOOLS)


@pytest.mark.parametrize(
    "starts, text, expected",
    [
        (
            True,
            "\nLet me think.\n\nStep two.\n</think>\n\nThe answer.",
            [("reasoning", "Let me think.\n\nStep two."), ("text", "The answer.")],
        ),
        (False, "<think>\nLet me think.\n</think>\n\nAnswer.", [("reasoning", "Let me think."), ("text", "Answer.")]),
        (False, "The answer <think>is</think> plain.", [("text", "The answer <think>is</think> plain.")]),
        (False, "<b>bold</b>", [("text", "<b>bold</b>")]),
        (False, "<thin", [("text", "<thin")]),
        (True, "\n\n</think>\n\nHi", [("text", "Hi")]),
        (True, "\nonly reasoning, cut off\n", [("reasoning", "only reasoning, cut off\n")]),
        (True, "\nwhy\n</think>\n\n  indented\n", [("reasoning", "why"), ("text", "  indented\n")]),
        (True, "\nx\n\n</think>\n\n\n\ny</think>z", [("reasoning", "x\n"), ("text", "y</think>z")]),
    ],
)
def test_reasoning_split(starts, text, expected):
    assert assert_stream_equals_oneshot(splitter(starts), text) == expected


def test_without_a_reasoning_parser_everything_is_answer():
    text = "<think>\nx\n</think>\n\ny"
    assert assert_stream_equals_oneshot(splitter(reasoning=None), text) == [("text", text)]
    with pytest.raises(ValueError):
        OutputSplitter(None, None, starts_in_reasoning=True)


def test_reasoning_streams_while_markers_are_held():
    split = OutputSplitter(QWEN, None, starts_in_reasoning=True)
    assert split.feed("\nab") == [ReasoningDelta("ab")]
    assert split.feed("c\n</th") == [ReasoningDelta("c")]  # newline and partial marker held
    assert split.feed("ink>\n") == []
    assert split.feed("\nok") == [TextDelta("ok")]
    assert split.finish() == []


@pytest.mark.parametrize("starts", [False, True])
def test_tool_calls_are_parsed_in_the_answer_only(starts):
    reasoning = "\nShould I emit <tool_call> now?\n"
    text = ("" if starts else "<think>") + reasoning + "</think>\n\nSearching.\n" + XML_CALL + "\n"
    events = assert_stream_equals_oneshot(splitter(starts, xml_tools), text)
    assert events == [
        ("reasoning", "Should I emit <tool_call> now?"),
        ("text", "Searching."),
        ("call", "search", '{"q": "why <b>", "n": 2}'),
    ]


@pytest.mark.parametrize(
    "text",
    [
        "\nplan\n</think>\n\n" + XML_CALL + "\n" + XML_CALL.replace("why <b>", "again"),
        "\nplan\n</think>\n\nMention <tool_call> and go on.",
        "\nplan\n</think>\n\n" + XML_CALL + "\nThen prose after the call.",
        "\nplan\n</think>\n\n" + XML_CALL.replace("<parameter=n>", "<parameter=q>"),
    ],
)
def test_splitter_streaming_equals_one_shot_with_tools(text):
    events = assert_stream_equals_oneshot(splitter(True, xml_tools), text)
    answer = text.split("</think>\n\n", 1)[1]
    if not any(e[0] == "call" for e in events):  # fallback keeps every answer byte
        assert events == [("reasoning", "plan"), ("text", answer)]


def test_hermes_through_the_splitter():
    call = '<tool_call>\n{"name": "search", "arguments": {"n": 1, "q": "x"}}\n</tool_call>'
    make = splitter(False, lambda: HermesJsonToolParser(TOOLS))
    events = assert_stream_equals_oneshot(make, "Sure.\n" + call)
    assert events == [("text", "Sure."), ("call", "search", '{"n": 1, "q": "x"}')]


def test_reasoning_tokens_count_feeds_inside_the_channel():
    tokens = ["<think>", "\n", "Hmm", "\n", "</think>", "\n\n", "Hi", "!"]
    split = OutputSplitter(QWEN, None)
    for tok in tokens:
        split.feed(tok)
    split.finish()
    assert split.reasoning_tokens == 5  # both markers count; the answer does not

    split = OutputSplitter(QWEN, None, starts_in_reasoning=True)
    for tok, n in [("", 1), ("Hmm", 3), ("</th", 1), ("ink>", 1), ("\n\nHi", 2)]:
        split.feed(tok, num_tokens=n)
    assert split.reasoning_tokens == 6

    split = OutputSplitter(QWEN, None)
    split.feed("No thinking here.")
    assert split.reasoning_tokens == 0


def test_tool_call_parse_diagnostics():
    assert OutputSplitter(QWEN, None).tool_call_parse == {
        "marker_seen": False, "calls": 0, "omitted_empty_args": 0, "mismatched_args": 0, "fallback_reason": "none",
    }
    split = OutputSplitter(QWEN, xml_tools(), starts_in_reasoning=True)
    deltas = split.feed("\nx\n</think>\n\n" + XML_CALL.replace("\n2\n", "\n\n")) + split.finish()
    assert timeline(deltas) == [("reasoning", "x"), ("call", "search", '{"q": "why <b>"}')]
    assert split.tool_call_parse == {
        "marker_seen": True, "calls": 1, "omitted_empty_args": 1, "mismatched_args": 0, "fallback_reason": "none",
    }


def test_plain_answer_streams_without_holdback():
    split = OutputSplitter(QWEN, xml_tools())
    assert split.feed("Hello") == [TextDelta("Hello")]
    assert split.feed(" world <") == [TextDelta(" world")]
    assert split.feed("br>") == [TextDelta(" <br>")]
    assert timeline(run_chunks(lambda: split, [])) == []
