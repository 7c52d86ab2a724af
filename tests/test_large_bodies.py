"""A large request body is decoded and checked off the event loop: other clients are not kept waiting."""

from __future__ import annotations

import json
import threading
import time

import httpx

from server_harness import server_fixture

server = server_fixture("--max-request-mib", "64", "--max-context", "256", "--log-level", "warning")
#: many small messages: decoding and checking them is work per message, not per byte
MESSAGES = 300_000


def test_health_answers_promptly_while_a_20_mb_body_is_processed(server):
    # every message is valid but the last (a participant name): the 400 comes after all of them were checked
    messages = [{"role": "user", "content": "a short message " * 3}] * MESSAGES
    messages.append({"role": "user", "content": "x", "name": "bob"})
    body = json.dumps({"messages": messages, "max_tokens": 1}).encode()
    assert len(body) > 20_000_000
    answer: dict[str, httpx.Response] = {}

    def post() -> None:
        answer["big"] = httpx.post(f"{server}/v1/chat/completions", content=body, timeout=120,
                                   headers={"content-type": "application/json"})

    sender = threading.Thread(target=post)
    sender.start()
    waits = []
    while sender.is_alive():  # probe until the big request is answered, so its processing is covered
        started = time.monotonic()
        assert httpx.get(f"{server}/health", timeout=30).status_code == 200
        waits.append(time.monotonic() - started)
        time.sleep(0.02)
    sender.join()
    big = answer["big"]
    assert big.status_code == 400 and big.json()["error"]["param"] == f"messages[{MESSAGES}].name", big.text
    assert max(waits) < 1.0, (max(waits), len(waits))
