"""Responses output rendering fed crafted engine events: Items, SSE lifecycle, tool identity.

The tiny random model rarely writes reasoning or tool markup, so these tests hand the
renderer the event sequences an engine would produce for such output;
tests/test_openai_responses.py covers the endpoints end to end.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from ninfer_plugins.reasoning.qwen3 import QWEN3
from ninfer.engine.request import GenerationEvent, RequestTimings
from ninfer.errors import InvalidRequestError
from ninfer.frontend.output_split import OutputSplitter
from ninfer.frontend.parsers import tool_specs
from ninfer.frontend.choice_output import ChoiceProgress
from ninfer_plugins.protocols.openai_responses.response import Echo, Turn
from ninfer_plugins.protocols.openai_responses.schema import CreateRequest
from ninfer_plugins.protocols.openai_responses.sealed import unseal
from ninfer_plugins.protocols.openai_responses.store import StoreCapacityError
from ninfer_plugins.protocols.openai_responses.stream import frames
from ninfer_plugins.protocols.openai_responses.tools import resolve_tools
from ninfer_plugins.tool_parsers.hermes_json import HermesJsonToolParser

QWEN = QWEN3
PARAMS = {"type": "object", "properties": {"city": {"type": "string"}}}
TOOLS = [
    {"type": "function", "name": "get_weather", "parameters": PARAMS},
    {"type": "namespace", "name": "crm", "description": "Customer records",
     "tools": [{"type": "function", "name": "get_weather", "description": "Weather at a customer",
                "parameters": PARAMS}]},
]


def call(name: str, city: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {{"city": "{city}"}}}}\n</tool_call>'


def crafted(pieces: list[str], finish: str = "stop") -> list[GenerationEvent]:
    """Admission, then one event per output piece (the last finishes)."""
    t = RequestTimings(arrival=0.0, admitted=1.0)
    out = [GenerationEvent("r", [], "", 20, 16, 0, t, 16)]
    for k, piece in enumerate(pieces):
        done = k == len(pieces) - 1
        out.append(GenerationEvent("r", [k + 1], piece, 20, 16, k + 1, t, 20, finished=done,
                                   finish_reason=finish if done else None))
    if not pieces:
        out.append(GenerationEvent("r", [], "", 20, 16, 0, t, 20, finished=True, finish_reason=finish))
    return out


def turn(include=None, tools=TOOLS) -> Turn:
    toolset = resolve_tools(tools, None, None)
    splitter = OutputSplitter(QWEN, HermesJsonToolParser(tool_specs(toolset.definitions)))
    echo = Echo.of(CreateRequest(model="m", tools=tools), "m")
    return Turn("resp_x", echo, ChoiceProgress(0, splitter), toolset.identities, include)


def stream(events: list[GenerationEvent], fail_after: int | None = None, store_fails: bool = False,
           **kw) -> tuple[Turn, list[tuple[str, dict]]]:
    """Run the SSE renderer; returns the turn and the (event name, payload) pairs."""
    t = turn(**kw)

    async def source():
        for i, e in enumerate(events):
            if fail_after is not None and i == fail_after:
                raise InvalidRequestError("boom", code="engine_said_no")
            yield t.choice.feed(e)

    async def finalize():
        if store_fails:
            raise StoreCapacityError("too big", param="store")
        return t.response()

    async def collect():
        return [f async for f in frames(t, source(), finalize)]

    out = []
    for raw in asyncio.run(collect()):
        name, data = raw.decode().rstrip("\n").split("\n")
        out.append((name.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return t, out


def pieces_of(text: str, size: int = 3) -> list[str]:
    return [text[i:i + size] for i in range(0, len(text), size)]


def fold(events: list[tuple[str, dict]]) -> dict[str, dict]:
    """Per item id: concatenated text/reasoning/argument deltas."""
    out: dict[str, dict] = {}
    for name, e in events:
        if name.endswith(".delta"):
            entry = out.setdefault(e["item_id"], {"delta": "", "output_index": e["output_index"]})
            entry["delta"] += e["delta"]
            assert entry["output_index"] == e["output_index"]
    return out


def test_reasoning_text_and_namespaced_calls_stream_and_aggregate_alike():
    text = "<think>\nwhich one\n</think>\n\nChecking." + "\n" + call("crm.get_weather", "Oslo") + "\n" + \
        call("get_weather", "Rome")
    t, events = stream(crafted(pieces_of(text)), include=["reasoning.encrypted_content"])
    names = [n for n, _ in events]
    assert all(n == e["type"] for n, e in events)
    assert [e["sequence_number"] for _, e in events] == list(range(len(events)))
    assert names[:2] == ["response.created", "response.in_progress"] and names[-1] == "response.completed"
    assert "[DONE]" not in json.dumps(events)
    final = events[-1][1]["response"]
    assert final["status"] == "completed" and final["completed_at"] is not None
    reasoning, message, ns_call, direct = final["output"]
    assert reasoning["content"] == [{"type": "reasoning_text", "text": "which one"}] and reasoning["summary"] == []
    assert unseal(reasoning["encrypted_content"]) == "which one"
    assert message["content"][0]["text"] == "Checking." and message["role"] == "assistant"
    assert (ns_call["namespace"], ns_call["name"], json.loads(ns_call["arguments"])) == ("crm", "get_weather",
                                                                                          {"city": "Oslo"})
    assert "namespace" not in direct and direct["name"] == "get_weather"
    calls = [ns_call, direct]
    assert all(c["id"].startswith("fc_") and c["call_id"].startswith("call_") for c in calls)
    assert len({c["call_id"] for c in calls}) == 2 and len({i["id"] for i in final["output"]}) == 4
    # concatenated deltas equal the terminal Items; ids and indices never move
    folded = fold(events)
    assert folded[reasoning["id"]] == {"delta": "which one", "output_index": 0}
    assert folded[message["id"]] == {"delta": "Checking.", "output_index": 1}
    assert folded[ns_call["id"]]["delta"] == ns_call["arguments"]
    added = {e["item"]["id"]: e["output_index"] for n, e in events if n == "response.output_item.added"}
    done = {e["item"]["id"]: (e["output_index"], e["item"]) for n, e in events if n == "response.output_item.done"}
    assert added == {i["id"]: k for k, i in enumerate(final["output"])}
    assert {k: v[1] for k, v in done.items()} == {i["id"]: i for i in final["output"]}
    assert {n for n, e in events if n.startswith("response.function_call_arguments.done")}
    # the added event shows the namespace already; the aggregate is the same object
    ns_added = next(e["item"] for n, e in events if n == "response.output_item.added" and e["output_index"] == 2)
    assert ns_added["namespace"] == "crm" and ns_added["status"] == "in_progress"
    assert t.response()["output"] == final["output"]
    assert final["usage"]["output_tokens_details"]["reasoning_tokens"] > 0
    assert final["usage"]["input_tokens_details"]["cached_tokens"] == 16


def test_lifecycle_order_of_one_message():
    _, events = stream(crafted(["Hel", "lo"]))
    assert [n for n, _ in events] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.completed"]


def test_incomplete_reasoning_only_has_no_invented_message():
    _, events = stream(crafted(pieces_of("<think>\nstill thinking"), finish="length"))
    final = events[-1][1]["response"]
    assert events[-1][0] == "response.incomplete" and final["incomplete_details"] == {"reason": "max_output_tokens"}
    assert [i["type"] for i in final["output"]] == ["reasoning"] and final["output"][0]["status"] == "incomplete"
    assert final["completed_at"] is None and "encrypted_content" not in final["output"][0]


def test_completed_empty_turn_answers_an_empty_message():
    _, events = stream(crafted([]))
    (message,) = events[-1][1]["response"]["output"]
    assert message["content"][0]["text"] == "" and message["status"] == "completed"


def test_failure_after_the_stream_began_is_response_failed():
    _, events = stream(crafted(["Hel", "lo", " there"]), fail_after=2)
    name, last = events[-1]
    assert name == "response.failed" and last["response"]["status"] == "failed"
    assert last["response"]["error"] == {"code": "engine_said_no", "message": "boom"}
    assert last["response"]["output"][0]["status"] == "incomplete"
    assert [n for n, _ in events].count("response.failed") == 1


def test_a_response_the_store_cannot_hold_fails_the_stream():
    _, events = stream(crafted(["Hi"]), store_fails=True)
    names = [n for n, _ in events]
    assert names[-2:] == ["response.output_item.done", "response.failed"] and "response.completed" not in names
    assert events[-1][1]["response"]["error"]["code"] == "response_store_capacity_exceeded"


def test_failure_before_the_stream_began_stays_an_http_error():
    with pytest.raises(InvalidRequestError):
        stream(crafted(["x"]), fail_after=0)


def test_undeclared_tool_markup_stays_text():
    text = call("not_declared", "Oslo")
    _, events = stream(crafted(pieces_of(text)))
    (message,) = events[-1][1]["response"]["output"]
    assert message["type"] == "message" and message["content"][0]["text"] == text
