"""SIGTERM on a real server with long streams running in every protocol.

New requests get 503 in their protocol's shape while the server drains; the streams that
outlive the drain bound end with their protocol's terminal error event and a complete
body (no truncated chunked encoding); the log holds no traceback and the process exits 0.
"""

from __future__ import annotations

import json
import signal
import socket
import threading
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families
from server_harness import start_server, stop_server

DRAIN_MS = 1500
#: a JSON answer that cannot end before 2,000 characters: a long stream whatever the random model writes
LONG = {"type": "object", "properties": {"s": {"type": "string", "minLength": 2000}}, "required": ["s"]}
STREAMS = {
    "chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Tell a long story."}],
                                      "max_tokens": 3000, "logit_bias": {"300": 100}, "stream": True}),
    "responses": ("/v1/responses", {"input": "Tell a long story.", "model": "tiny:qwen3", "stream": True,
                                    "max_output_tokens": 3000, "reasoning": {"effort": "none"},
                                    "text": {"format": {"type": "json_schema", "name": "s", "schema": LONG}}}),
    "anthropic": ("/v1/messages", {"messages": [{"role": "user", "content": "Tell a long story."}], "model": "m",
                                   "max_tokens": 3000, "stream": True, "thinking": {"type": "disabled"},
                                   "output_config": {"format": {"type": "json_schema", "schema": LONG}}}),
}
#: content events that show a stream is generating
STARTED = {"chat": '"content"', "responses": "response.output_text.delta", "anthropic": "content_block_delta"}


class Reader(threading.Thread):
    """Reads one stream to its end, noting each line and how the body ended."""

    def __init__(self, base: str, path: str, body: dict):
        super().__init__(daemon=True)
        self.base, self.path, self.body = base, path, body
        self.lines: list[str] = []
        self.status = 0
        self.failure: BaseException | None = None

    def run(self) -> None:
        try:
            with httpx.stream("POST", f"{self.base}{self.path}", json=self.body, timeout=60) as response:
                self.status = response.status_code
                for line in response.iter_lines():
                    self.lines.append(line)
        except BaseException as exc:  # a truncated body raises here (httpx.RemoteProtocolError)
            self.failure = exc

    def saw(self, marker: str) -> bool:
        return any(marker in line for line in list(self.lines))


def _events(lines: list[str]) -> list[tuple[str, dict]]:
    """(event name or "", data) of each JSON data line."""
    out, name = [], ""
    for line in lines:
        if line.startswith("event: "):
            name = line[7:]
        elif line.startswith("data: ") and line != "data: [DONE]":
            out.append((name, json.loads(line[6:])))
            name = ""
    return out


def _in_flight(base: str) -> float:
    """The server's count of generation requests holding a capacity slot."""
    text = httpx.get(f"{base}/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        if family.name == "ninfer:requests_in_flight":
            return sum(sample.value for sample in family.samples)
    raise AssertionError("no ninfer:requests_in_flight gauge in /metrics")


def _refusals(base: str) -> None:
    """While draining: each protocol refuses new work in its own shape, with Retry-After."""
    for name, (path, body) in STREAMS.items():
        response = httpx.post(f"{base}{path}", json={**body, "stream": False}, timeout=10)
        assert response.status_code == 503 and response.headers["retry-after"] == "5", (name, response.text)
        error = response.json()
        if name == "anthropic":
            assert error["type"] == "error" and error["request_id"] == response.headers["request-id"]
            assert error["error"]["type"] == "api_error"
        else:
            assert error["error"]["code"] == "server_shutting_down"
    health = httpx.get(f"{base}/health", timeout=10)
    assert health.status_code == 503 and health.json() == {"status": "unavailable"}


def test_sigterm_ends_streams_that_outlive_the_drain_with_their_error_event():
    server = start_server("--max-concurrency", "4", "--max-context", "4096", "--kv-capacity", "16384",
                          "--drain-timeout-ms", str(DRAIN_MS),
                          "--log-stats-interval-ms", "0")
    try:
        readers = {name: Reader(server, path, body) for name, (path, body) in STREAMS.items()}
        aggregate = Reader(server, STREAMS["chat"][0], {**STREAMS["chat"][1], "stream": False})
        for reader in [*readers.values(), aggregate]:
            reader.start()
        deadline = time.monotonic() + 60
        # the aggregate shows nothing until it ends: the server's in-flight gauge says it holds a slot
        while not (all(r.saw(STARTED[name]) for name, r in readers.items()) and _in_flight(server) == 4):
            assert time.monotonic() < deadline, {name: r.lines[:5] for name, r in readers.items()}
            time.sleep(0.05)
        signaled = time.monotonic()
        server.process.send_signal(signal.SIGTERM)
        time.sleep(0.2)
        _refusals(server)
        assert server.process.wait(30) == 0
        took = time.monotonic() - signaled
        for reader in [*readers.values(), aggregate]:
            reader.join(10)
            assert reader.failure is None, (reader.path, reader.failure)
        logs = server.logs()
    finally:
        stop_server(server)
    assert DRAIN_MS / 1000 <= took < DRAIN_MS / 1000 + 10, took
    chat = _events(readers["chat"].lines)
    assert chat[-1][1]["error"]["code"] == "server_shutting_down" and "data: [DONE]" not in readers["chat"].lines
    responses = _events(readers["responses"].lines)
    kind, failed = responses[-1]
    assert kind == "response.failed" and failed["response"]["error"]["code"] == "server_shutting_down"
    assert [data["sequence_number"] for _, data in responses] == list(range(len(responses)))
    anthropic = _events(readers["anthropic"].lines)
    assert anthropic[-1][0] == "error" and anthropic[-1][1]["error"]["type"] == "api_error"
    assert aggregate.status == 503 and json.loads(aggregate.lines[0])["error"]["code"] == "server_shutting_down"
    assert "Traceback" not in logs and "Exception in ASGI application" not in logs, logs
    assert "ending 4 request(s) still running" in logs and "server stopped" in logs, logs
    assert "still busy" not in logs  # every client read its last event: no connection had to be cut


def test_a_body_still_arriving_at_shutdown_is_answered_503_in_its_shape():
    server = start_server("--drain-timeout-ms", "500", "--body-timeout-ms", "60000", "--log-stats-interval-ms", "0")
    try:
        host, port = server.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=20) as sock:
            sock.sendall(b"POST /v1/messages HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 500\r\n\r\n{\"model\": ")
            time.sleep(0.3)
            server.process.send_signal(signal.SIGTERM)
            answer = b""
            while chunk := sock.recv(65536):
                answer += chunk
        assert server.process.wait(30) == 0
        logs = server.logs()
    finally:
        stop_server(server)
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 503 "), answer
    error = json.loads(body)
    assert error["type"] == "error" and "shutting down" in error["error"]["message"]
    assert "Traceback" not in logs and "Exception in ASGI application" not in logs, logs
