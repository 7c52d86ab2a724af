"""A real Codex CLI request shape, replayed with its headers against a long-context tiny model.

The fixture (/work/shared/fixtures) renders to about 22k tokens with the tiny
tokenizer, past the tiny model's 8192 rotary positions, so the test serves a copy of
the tiny checkpoint whose config allows longer sequences. Its first prefill dominates
this file's run time (CPU reference attention); later turns reuse its pages.
"""

from __future__ import annotations

from _shared import shared_path

import json
import shutil
from pathlib import Path

import httpx
import pytest
from server_harness import running_server

FIXTURE = shared_path("fixtures", "codex-0.171.0-responses-request.json")
CONTEXT = 32768
PAGE = 16

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not FIXTURE.exists(), reason="the Codex request fixture is not available")]


@pytest.fixture(scope="module")
def codex():
    return json.loads(FIXTURE.read_text())


@pytest.fixture(scope="module")
def server(tiny_qwen3, tmp_path_factory):
    model = tmp_path_factory.mktemp("tiny-long") / "qwen3"
    shutil.copytree(tiny_qwen3, model)
    config = json.loads((model / "config.json").read_text())
    config["max_position_embeddings"] = CONTEXT
    (model / "config.json").write_text(json.dumps(config))
    with running_server("--max-context", str(CONTEXT), "--model-id", "local", "--default-max-tokens", "6",
                        model=str(model)) as url:
        yield url


def events_of(response: httpx.Response) -> list[tuple[str, dict]]:
    out = []
    for block in response.read().decode().split("\n\n"):
        lines = [line for line in block.split("\n") if line and not line.startswith(":")]
        if lines:
            assert lines[0].startswith("event: ") and lines[1].startswith("data: ")
            out.append((lines[0][7:], json.loads(lines[1][6:])))
    return out


def stream(server, body: dict, headers: dict) -> list[tuple[str, dict]]:
    with httpx.stream("POST", f"{server}/v1/responses", headers=headers, content=json.dumps(body),
                      timeout=600) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        return events_of(r)


def check_lifecycle(events: list[tuple[str, dict]]) -> dict:
    """The common SSE contract; returns the terminal Response."""
    assert all(name == e["type"] for name, e in events)
    assert [e["sequence_number"] for _, e in events] == list(range(len(events)))
    names = [name for name, _ in events]
    assert names[:2] == ["response.created", "response.in_progress"]
    assert names[-1] in ("response.completed", "response.incomplete")
    final = events[-1][1]["response"]
    done = [e["item"] for name, e in events if name == "response.output_item.done"]
    assert done == final["output"] and final["store"] is False
    return final


def test_codex_turns(server, codex):
    body, headers = codex["body"], {k: v for k, v in codex["headers"].items()}
    prompt_fields = {k: body[k] for k in ("model", "input", "tools", "tool_choice", "parallel_tool_calls", "reasoning")}
    tokens = httpx.post(f"{server}/v1/responses/input_tokens", json=prompt_fields, timeout=60).json()["input_tokens"]
    assert 20000 < tokens < CONTEXT

    first = check_lifecycle(stream(server, body, headers))
    assert first["usage"]["input_tokens"] == tokens and first["usage"]["output_tokens"] <= 6
    assert first["tools"] == body["tools"] and first["prompt_cache_key"] == body["prompt_cache_key"]
    assert "leaving out 1 hosted tool(s) the model cannot call: web_search" in server.logs()
    for item in first["output"]:
        assert "encrypted_content" in item if item["type"] == "reasoning" else True

    # store: false, so the next turn replays the whole history, as Codex does
    thanks = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Thanks"}]}
    follow = {**body, "input": [*body["input"], *first["output"], thanks]}
    second = check_lifecycle(stream(server, follow, headers))
    assert second["usage"]["input_tokens_details"]["cached_tokens"] >= (tokens - 2) // PAGE * PAGE

    probe = httpx.post(f"{server}/v1/responses", json={"model": "local", "input": [], "max_output_tokens": 1,
                                                       "store": False}, timeout=60)
    assert probe.status_code == 200 and probe.json()["usage"]["output_tokens"] <= 1

    forced = httpx.post(f"{server}/v1/responses", json={**body, "tool_choice": {"type": "web_search"}}, timeout=60)
    assert forced.status_code == 400 and forced.json()["error"]["param"] == "tool_choice"
