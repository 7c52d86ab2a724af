"""Slow and idle clients against a real server, over raw sockets: they are closed, others are not held up.

The deadlines are shortened (1 s for headers, 1 s plus 1 s per KiB for a body) so each
case takes a couple of seconds; ninfer.server.connections documents the rules.
"""

from __future__ import annotations

import json
import socket
import time
from contextlib import ExitStack

import httpx
import pytest
from server_harness import server_fixture

MAX_CONNECTIONS = 24
server = server_fixture("--header-timeout-ms", "1000", "--body-timeout-ms", "1000", "--body-min-rate", "1024",
                        "--max-connections", str(MAX_CONNECTIONS), "--max-concurrency", "2",
                        "--log-stats-interval-ms", "0")
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def _connect(base: str) -> socket.socket:
    host, port = base.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=10)
    return sock


def _head(path: str, length: int, extra: str = "") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
            f"Content-Length: {length}\r\n{extra}\r\n").encode()


def _read_all(sock: socket.socket, timeout: float = 10) -> bytes:
    """Everything until the server closes the connection."""
    sock.settimeout(timeout)
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def _closed_after(sock: socket.socket, trickle: bytes = b"", every: float = 0.25, limit: float = 10,
                  since: float | None = None) -> tuple[float, bytes]:
    """Send ``trickle`` a byte at a time until the server closes; (seconds since ``since``
    or now, what it answered)."""
    started = time.monotonic() if since is None else since
    sock.settimeout(every)
    data = b""
    for byte in [trickle[i:i + 1] for i in range(len(trickle))] + [b""] * int(limit / every):
        try:
            if byte:
                sock.sendall(byte)
            chunk = sock.recv(65536)
            if not chunk:
                return time.monotonic() - started, data
            data += chunk
        except socket.timeout:
            continue
        except (BrokenPipeError, ConnectionResetError):
            return time.monotonic() - started, data
    raise AssertionError(f"still open after {limit} s: {data!r}")


def _quick(server, timeout: float = 5.0) -> None:
    """A well-behaved client is answered at once."""
    started = time.monotonic()
    assert httpx.get(f"{server}/health", timeout=timeout).status_code == 200
    response = httpx.post(f"{server}/v1/chat/completions", json=CHAT, timeout=timeout)
    assert response.status_code == 200, response.text
    assert time.monotonic() - started < timeout


def test_a_silent_connection_is_closed_at_the_header_deadline(server):
    with _connect(server) as sock:
        took, answer = _closed_after(sock)
    assert 0.8 < took < 4 and answer == b""  # nothing was asked, so nothing is answered


def test_trickled_headers_get_a_408_and_others_are_answered_meanwhile(server):
    with ExitStack() as stack:
        since = time.monotonic()
        slow = [stack.enter_context(_connect(server)) for _ in range(8)]
        for sock in slow:
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\n")
        _quick(server)
        took, answer = _closed_after(slow[0], trickle=b"X-Slow: " + b"a" * 100, since=since)
    assert 0.8 < took < 4, took
    assert answer.startswith(b"HTTP/1.1 408 ") and b'"code": "request_timeout"' in answer


@pytest.mark.parametrize(("path", "shape"), [("/v1/chat/completions", "openai"), ("/v1/messages", "anthropic")])
def test_a_body_at_one_byte_a_second_gets_a_408_in_the_routes_shape(server, path, shape):
    body = json.dumps({**CHAT, "model": "m"}).encode()
    with _connect(server) as sock:
        since = time.monotonic()
        sock.sendall(_head(path, len(body)) + body[:5])
        _quick(server)
        took, answer = _closed_after(sock, trickle=body[5:], every=1.0, since=since)
    assert 0.8 < took < 5, took
    head, _, payload = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408 "), answer
    error = json.loads(payload)
    if shape == "anthropic":
        assert error["type"] == "error" and "did not arrive in time" in error["error"]["message"]
    else:
        assert error["error"]["code"] == "request_timeout"


def test_a_slow_but_steady_body_is_read(server):
    # 3 KiB at about 2 KiB/s: above the minimum rate, so the deadline keeps moving.
    body = json.dumps({**CHAT, "user": "x" * 3000}).encode()
    with _connect(server) as sock:
        sock.sendall(_head("/v1/chat/completions", len(body)))
        for i in range(0, len(body), 200):
            sock.sendall(body[i:i + 200])
            time.sleep(0.1)
        sock.settimeout(30)
        answer = sock.recv(65536)
    assert answer.startswith(b"HTTP/1.1 200 "), answer[:200]


def test_streams_and_kept_alive_requests_outlast_the_header_deadline(server):
    body = {**CHAT, "max_tokens": 20, "stream": True}
    with httpx.Client(base_url=server, timeout=60) as client:
        with client.stream("POST", "/v1/chat/completions", json=body) as response:
            lines = response.iter_lines()
            first = next(lines)
            time.sleep(1.5)  # a reader slower than the header deadline: answering is not waiting on it
            rest = list(lines)
        assert first.startswith("data: ") and "data: [DONE]" in rest, rest[-3:]
        assert client.get("/health").status_code == 200  # the same connection, kept alive


def test_the_connection_cap_evicts_idle_connections_then_refuses(server):
    with ExitStack() as stack:
        idle = [stack.enter_context(_connect(server)) for _ in range(MAX_CONNECTIONS)]
        time.sleep(0.2)
        _quick(server)  # its connection made room by closing the oldest idle one
        assert _closed_after(idle[0], limit=2)[1] == b""
        for sock in idle:
            sock.close()
        # Every connection busy with a request (a body still arriving): the next one is refused.
        busy = [stack.enter_context(_connect(server)) for _ in range(MAX_CONNECTIONS)]
        for sock in busy:
            sock.sendall(_head("/v1/chat/completions", 1000) + b"{")
        time.sleep(0.3)
        refused = httpx.get(f"{server}/health", timeout=5)
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["code"] == "too_many_connections"
        for sock in busy:
            sock.close()
    time.sleep(0.3)
    _quick(server)
