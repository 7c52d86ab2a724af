"""A client that hangs up mid-generation cancels its request and frees its KV pages.

One real server runs one request at a time in a KV pool that holds one long request
only, with a short pending deadline: while a dropped request still ran (or held its
pages) the next one could not be admitted and would get 503 instead of an answer.
"""

from __future__ import annotations

import json
import re
import socket
import time
from urllib.parse import urlsplit

import httpx
import pytest
from server_harness import server_fixture

CONTEXT = 4096
PENDING_MS = 4000
server = server_fixture("--max-concurrency", "1", "--max-context", str(CONTEXT), "--kv-capacity", str(CONTEXT),
                        "--prefill-chunk", "256", "--pending-timeout-ms", str(PENDING_MS),
                        "--protocols", "openai_chat,openai_completions", "--log-stats-interval-ms", "0")
#: far more tokens than the test waits for: finishing it would take many seconds
LONG = 3900


def _long_body(path: str, stream: bool) -> dict:
    # A huge bias on one ordinary token keeps the model from ever sampling EOS.
    common = {"max_tokens": LONG, "temperature": 0, "logit_bias": {"300": 100}, "stream": stream}
    if path == "/v1/completions":
        return {"prompt": "Tell a very long story.", **common}
    return {"messages": [{"role": "user", "content": "Tell a very long story."}], **common}


def _drop_streaming(base_url: str, path: str) -> None:
    """Read a few events, then close the connection."""
    with httpx.stream("POST", f"{base_url}{path}", json=_long_body(path, True), timeout=30) as response:
        assert response.status_code == 200
        events = 0
        for line in response.iter_lines():
            events += line.startswith("data: ")
            if events >= 5:
                break
    # leaving the block closes the half-read response and with it the TCP connection


def _drop_aggregate(base_url: str, path: str) -> None:
    """Send the whole request over a raw socket, wait while it generates, then hang up."""
    url = urlsplit(base_url)
    payload = json.dumps(_long_body(path, False)).encode()
    head = (f"POST {path} HTTP/1.1\r\nHost: {url.netloc}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\n\r\n").encode()
    with socket.create_connection((url.hostname, url.port), timeout=10) as sock:
        sock.sendall(head + payload)
        time.sleep(1.0)  # admitted and decoding by now; nothing comes back before the end
        sock.setblocking(False)
        with pytest.raises(BlockingIOError):
            sock.recv(1)  # no response yet: the generation is still running


def _log_line(base_url, path: str, after: int) -> str:
    """The request-log line of the dropped request (it is logged once its handler has unwound)."""
    pattern = re.compile(rf"req_[0-9a-f]{{32}} \w+ POST {re.escape(path)} (\d+|no response), .*")
    for _ in range(100):
        for line in base_url.logs()[after:].splitlines():
            if pattern.search(line) and "client disconnected" in line:
                return line
        time.sleep(0.1)
    raise AssertionError(f"no cancellation logged:\n{base_url.logs()[after:]}")


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
@pytest.mark.parametrize("drop", [_drop_streaming, _drop_aggregate], ids=["stream", "aggregate"])
def test_a_dropped_request_is_cancelled_and_frees_its_pages(server, path, drop):
    after = len(server.logs())
    drop(server, path)
    started = time.monotonic()
    # The next request needs the only running slot and most of the pool.
    follow = httpx.post(f"{server}{path}", json={**_long_body(path, False), "max_tokens": 8}, timeout=30)
    assert follow.status_code == 200, follow.text
    assert time.monotonic() - started < PENDING_MS / 1000
    line = _log_line(server, path, after)
    completion = int(re.search(r"completion (\d+) tokens", line).group(1))
    assert 0 < completion < LONG  # it was generating, and stopped early


def test_a_request_dropped_while_waiting_for_admission_never_runs(server):
    after = len(server.logs())
    path = "/v1/chat/completions"
    with httpx.stream("POST", f"{server}{path}", json=_long_body(path, True), timeout=30) as running:
        lines = running.iter_lines()  # kept referenced: dropping the iterator closes the stream
        next(lines)  # the only slot is busy from here on
        _drop_aggregate(server, path)  # queued behind it, then dropped
    started = time.monotonic()
    # Had the queued request survived, it would now run its long generation first.
    follow = httpx.post(f"{server}{path}", json={**_long_body(path, False), "max_tokens": 8}, timeout=30)
    assert follow.status_code == 200, follow.text
    assert time.monotonic() - started < PENDING_MS / 1000
    cancelled = [line for line in server.logs()[after:].splitlines() if "client disconnected" in line]
    # the queued one generated nothing (no token counts are logged), the running one did
    generated = sorted(bool(re.search(r"completion \d+ tokens", line)) for line in cancelled)
    assert generated == [False, True], "\n".join(cancelled)
