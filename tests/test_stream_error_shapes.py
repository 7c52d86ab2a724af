"""A queue timeout after the first keep-alive: HTTP 200, then one error event in the protocol's shape.

The keep-alive that reports a waiting request's liveness sends the status line, so a
refusal that comes later can only be an event. A real engine in-process runs one long
request; streaming requests of every protocol wait behind it until their pending
deadline passes. The keep-alive interval is shortened to keep the test quick.
"""

from __future__ import annotations

import asyncio
import json

import pytest
from _served import call, served_state

from ninfer.server.app import build_app

MODEL = "tiny"
ASK = [{"role": "user", "content": "hi"}]
STREAMS = {
    "chat": ("/v1/chat/completions", {"messages": ASK, "max_tokens": 4}),
    "completions": ("/v1/completions", {"prompt": "hi", "max_tokens": 4}),
    "responses": ("/v1/responses", {"model": MODEL, "input": "hi", "max_output_tokens": 4}),
    "anthropic": ("/v1/messages", {"model": "m", "messages": ASK, "max_tokens": 4}),
}


@pytest.fixture(scope="module")
def app(tiny_qwen3):
    state = served_state(tiny_qwen3, "--model-id", MODEL, "--max-concurrency", "1", "--pending-timeout-ms", "1500",
                         "--max-context", "4096", "--log-stats-interval-ms", "0")
    yield build_app(state)
    state.engine.shutdown()


def _frames(text: str) -> list[tuple[str, str]]:
    """(event name, data) per frame; comments as ("comment", text)."""
    out = []
    for block in text.strip().split("\n\n"):
        if block.startswith(":"):
            out.append(("comment", block))
            continue
        fields = dict(line.split(": ", 1) for line in block.splitlines())
        out.append((fields.get("event", ""), fields.get("data", "")))
    return out


def test_a_queue_timeout_after_a_keep_alive_is_an_error_event_in_each_protocols_shape(app, monkeypatch):
    monkeypatch.setattr("ninfer.server.sse.KEEPALIVE_S", 0.3)
    blocker = {"messages": ASK, "max_tokens": 3000, "logit_bias": {"300": 100}}

    async def main():
        running = asyncio.ensure_future(call(app, "POST", "/v1/chat/completions", json=blocker, timeout=120))
        await asyncio.sleep(0.5)  # admitted: the only running slot is taken
        try:
            answers = await asyncio.gather(*[call(app, "POST", path, json={**body, "stream": True}, timeout=60)
                                             for path, body in STREAMS.values()])
        finally:
            running.cancel()
        return dict(zip(STREAMS, answers))

    answers = asyncio.run(main())
    for name, response in answers.items():
        assert response.status_code == 200, (name, response.text)
        assert response.headers["content-type"].startswith("text/event-stream")
    chat, completions = _frames(answers["chat"].text), _frames(answers["completions"].text)
    for frames in (chat, completions):
        assert frames[0][0] == "comment" and len([f for f in frames if f[0] != "comment"]) == 1
        assert json.loads(frames[-1][1])["error"]["code"] == "request_queue_timeout"
    responses = [f for f in _frames(answers["responses"].text) if f[0] != "comment"]
    assert [name for name, _ in responses] == ["response.created", "response.failed"]
    created, failed = (json.loads(data) for _, data in responses)
    assert [created["sequence_number"], failed["sequence_number"]] == [0, 1]
    assert created["response"]["status"] == "in_progress"
    assert failed["response"]["status"] == "failed"
    assert failed["response"]["error"]["code"] == "request_queue_timeout"
    assert failed["response"]["id"] == created["response"]["id"]
    anthropic = _frames(answers["anthropic"].text)
    # no Anthropic event may precede message_start: the wait is kept alive by the comment
    assert anthropic[0][0] == "comment" and [f[0] for f in anthropic if f[0] != "comment"] == ["error"]
    error = json.loads(anthropic[-1][1])
    assert error["type"] == "error" and error["error"]["type"] == "timeout_error"
    assert error["request_id"] == answers["anthropic"].headers["request-id"]
