"""The first request Claude Code 2.1.197 sends, replayed with its headers and ``?beta=true``.

The fixture (/work/shared/fixtures) holds 24 tools, thinking enabled with budget_tokens
31999 of max_tokens 32000, context_management, metadata, the billing header and cache
markers; with the tiny tokenizer it renders to about 66k prompt tokens. Prefilling that
on a CPU takes minutes (and the tiny model's rotary table ends at 8192 positions), so
the unmodified request is followed up to ``message_start`` (sent once the engine has
admitted it) and then dropped, and the same request with its long filler strings cut
short is served as a whole streamed turn, with stop sequences added to keep the random
model's output short.
"""

from __future__ import annotations

from _shared import shared_path

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_harness import server_fixture

FIXTURE = shared_path("fixtures", "claude-code-2.1.197-messages-request.json")
#: the prompt plus the request's 32000 output tokens must fit
server = server_fixture("--max-context", "98304", "--prefill-chunk", "512", "--protocols", "anthropic_messages")
pytestmark = pytest.mark.skipif(not FIXTURE.is_file(), reason="the Claude Code fixture is not available")
#: anything the random model writes soon contains one of these
STOPS = [" ", "e", "a", "t", "o", "\n", "<"]
SHORT = 8


@pytest.fixture(scope="module")
def captured() -> dict[str, Any]:
    return json.loads(FIXTURE.read_text())


def send(server: str, captured: dict[str, Any], body: dict[str, Any]) -> Any:
    return httpx.stream(captured["method"], f"{server}{captured['path']}", headers=captured["headers"],
                        content=json.dumps(body), timeout=120)


def count(server: str, captured: dict[str, Any], body: dict[str, Any]) -> int:
    path = captured["path"].replace("/v1/messages", "/v1/messages/count_tokens")
    r = httpx.post(f"{server}{path}", headers=captured["headers"], content=json.dumps(body), timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["input_tokens"]


def events(lines: Any) -> Any:
    """``(name, payload)`` per SSE event."""
    name = None
    for line in lines:
        if line.startswith("event: "):
            name = line.removeprefix("event: ")
        elif line.startswith("data: "):
            yield name, json.loads(line.removeprefix("data: "))


def shorten(value: Any) -> Any:
    """Long filler strings cut short; keys, types, short values and the billing line kept."""
    if isinstance(value, dict):
        return {k: shorten(v) for k, v in value.items()}
    if isinstance(value, list):
        return [shorten(v) for v in value]
    if isinstance(value, str) and len(value) > 40 and not value.startswith("x-anthropic-billing-header:"):
        return value[:SHORT]
    return value


def test_unmodified_request_is_admitted_as_a_streamed_turn(server, captured):
    body = captured["body"]
    total = count(server, captured, body)
    assert total > 60_000
    with send(server, captured, body) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["request-id"] and r.headers["content-type"].startswith("text/event-stream")
        stream = events(r.iter_lines())
        name, start = next(stream)
        assert name == "message_start" and next(stream)[0] == "ping"
    usage = start["message"]["usage"]
    assert usage["input_tokens"] + usage["cache_read_input_tokens"] == total
    assert start["message"]["model"] == body["model"]
    # dropping the stream aborted the request: the slot and its KV pages are free again
    small = {"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}
    assert httpx.post(f"{server}/v1/messages", json=small, timeout=60).status_code == 200


def test_the_same_shape_is_served_to_the_end(server, captured):
    shaped = shorten(captured["body"])
    assert len(shaped["tools"]) == 24 and shaped["thinking"] == {"type": "enabled", "budget_tokens": 31999}
    total = count(server, captured, shaped)
    with send(server, captured, {**shaped, "stop_sequences": STOPS}) as r:
        assert r.status_code == 200, r.read()
        seen = list(events(r.iter_lines()))
    names = [name for name, _ in seen]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    assert set(names[1:-2]) <= {"ping", "content_block_start", "content_block_delta", "content_block_stop"}
    assert all(payload["type"] == name for name, payload in seen)
    end = seen[-2][1]
    assert end["delta"]["stop_reason"] in ("stop_sequence", "end_turn", "tool_use")
    assert end["usage"]["input_tokens"] + end["usage"]["cache_read_input_tokens"] == total
    # Again without stop sequences: the prompt is cached now (the billing line is not part
    # of it), and content blocks stream; the turn is dropped after its first delta.
    with send(server, captured, shaped) as r:
        stream = events(r.iter_lines())
        name, start = next(stream)
        block = None
        for name, payload in stream:
            if name == "content_block_start":
                block = payload["content_block"]["type"]
            elif name == "content_block_delta":
                break
    assert start["message"]["usage"]["cache_read_input_tokens"] >= total - 16
    assert block in ("thinking", "text") and payload["delta"]["type"] == f"{block}_delta"
