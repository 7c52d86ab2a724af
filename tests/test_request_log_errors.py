"""The request log's refusals and errors, through the official SDKs on a real server.

A prompt plus output limit over the context is refused while the request is prepared:
the client's 400 names the field it sent (Responses' ``max_output_tokens``, Chat's
``max_completion_tokens`` or ``max_tokens``, Anthropic's ``max_tokens``) and the log
has one ``request_rejected`` (phase prepare) and no start. Anthropic's overload and queue
timeout are logged as its client got them (529 / 504, Anthropic's types), and a request
that does not think logs ``resolved_reasoning_effort: "none"``.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import anthropic
import httpx
import openai
import pytest
from server_harness import running_server

MODEL = "tiny:qwen3"
CONTEXT = 512
TOO_MANY = 5000
USER = [{"role": "user", "content": "Name a river."}]


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _hog_and_flood(url: str, answers: list) -> None:
    """One long stream holds the only slot; two more requests: one waits and times out, one finds no room."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Count to a thousand."}], "max_tokens": 480,
            "temperature": 0, "stream": True, "thinking": {"type": "disabled"}}

    def send() -> None:
        answers.append(httpx.post(f"{url}/v1/messages", json={"model": MODEL, "max_tokens": 1, "messages": USER},
                                  timeout=60))

    with httpx.stream("POST", f"{url}/v1/messages", json=body, timeout=60) as running:
        lines = running.iter_lines()  # kept: a discarded line iterator closes the connection
        while next(lines) != "event: message_start":  # admitted: it holds the only engine slot
            pass
        threads = [threading.Thread(target=send) for _ in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)


@pytest.fixture(scope="module")
def traffic(tmp_path_factory):
    log = tmp_path_factory.mktemp("request-log") / "errors.jsonl"
    flags = ("--request-log-jsonl", str(log), "--max-context", str(CONTEXT), "--max-concurrency", "1",
             "--max-pending-requests", "1", "--pending-timeout-ms", "1000")
    seen: dict = {}
    with running_server(*flags) as url:
        oa = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        an = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0)
        refusals = {
            "max_output_tokens": lambda: oa.responses.create(model=MODEL, input="hi", max_output_tokens=TOO_MANY),
            "max_completion_tokens": lambda: oa.chat.completions.create(model=MODEL, messages=USER,
                                                                        max_completion_tokens=TOO_MANY),
            "max_tokens": lambda: oa.chat.completions.create(model=MODEL, messages=USER, max_tokens=TOO_MANY),
        }
        for field, call in refusals.items():
            with pytest.raises(openai.BadRequestError) as e:
                call()
            seen[field] = e.value.body
        with pytest.raises(anthropic.BadRequestError) as e:
            an.messages.create(model=MODEL, messages=USER, max_tokens=TOO_MANY)
        seen["anthropic"] = e.value.body["error"]
        oa.chat.completions.create(model=MODEL, messages=USER, max_tokens=1, reasoning_effort="none")
        oa.responses.create(model=MODEL, input="hi", max_output_tokens=1, reasoning={"effort": "none"})
        an.messages.create(model=MODEL, messages=USER, max_tokens=1, thinking={"type": "disabled"})
        answers: list[httpx.Response] = []
        _hog_and_flood(url, answers)
        seen["flood"] = {r.status_code: r.json()["error"] for r in answers}
        deadline = time.monotonic() + 30  # the hog's terminal comes once its handler unwound
        while time.monotonic() < deadline:
            events = [r["event"] for r in _lines(log)]
            if events.count("request_start") == events.count("request_done") + events.count("request_error"):
                break
            time.sleep(0.1)
    return _lines(log), seen


def test_an_output_limit_over_the_context_names_the_field_and_is_a_preparation_refusal(traffic):
    lines, seen = traffic
    for field in ("max_output_tokens", "max_completion_tokens", "max_tokens"):
        assert (seen[field]["param"], seen[field]["code"]) == (field, "context_length_exceeded"), seen[field]
        assert f"plus {field} ({TOO_MANY})" in seen[field]["message"]
    assert seen["anthropic"]["message"].startswith("max_tokens: prompt (")
    rejected = [r for r in lines
                if r["event"] == "request_rejected" and r["error"]["code"] == "context_length_exceeded"]
    assert [r["error"]["param"] for r in rejected] == ["max_output_tokens", "max_completion_tokens", "max_tokens",
                                                       "max_tokens"]
    assert {r["phase"] for r in rejected} == {"prepare"}
    assert [r["protocol"] for r in rejected] == ["openai_responses", "openai_chat", "openai_chat",
                                                 "anthropic_messages"]
    starts = [r for r in lines if r["event"] == "request_start"]
    assert {r["request_id"] for r in rejected}.isdisjoint(r["request_id"] for r in starts)
    assert not any(r["event"] == "request_error" and r["error"] and r["error"]["code"] == "context_length_exceeded"
                   for r in lines)
    # what the Anthropic client read, field in front
    assert rejected[-1]["error"]["message"] == seen["anthropic"]["message"]


def test_a_request_that_does_not_think_logs_the_effort_none(traffic):
    lines, _ = traffic
    starts = [r for r in lines if r["event"] == "request_start" and r["output_budget"]["requested_max_tokens"] == 1
              and r["reasoning"]["thinking"] is False]
    by_protocol = {r["protocol"]: r["reasoning"] for r in starts}
    assert set(by_protocol) == {"openai_chat", "openai_responses", "anthropic_messages"}
    for reasoning in by_protocol.values():
        assert (reasoning["thinking"], reasoning["resolved_reasoning_effort"]) == (False, "none"), reasoning


def test_anthropic_overload_and_queue_timeout_are_logged_as_the_client_got_them(traffic):
    lines, seen = traffic
    assert {status: e["type"] for status, e in seen["flood"].items()} == {529: "overloaded_error",
                                                                          504: "timeout_error"}
    logged = {r["error"]["status"]: r["error"] for r in lines
              if r["event"] in ("request_rejected", "request_error") and r.get("error")
              and r["error"]["code"] in ("server_overloaded", "request_queue_timeout")}
    assert {s: (e["type"], e["message"]) for s, e in logged.items()} == {
        s: (e["type"], e["message"]) for s, e in seen["flood"].items()}
