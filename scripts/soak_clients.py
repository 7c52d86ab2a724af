"""The soak's client behaviours: what one request of each kind sends and what counts as a good end.

Each behaviour returns an outcome name (``ok``, ``shed`` for a 429, ``cut`` ...) or raises
:class:`Bad` with what went wrong. The runner (scripts/soak.py) picks them at random.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from typing import Callable, Optional
from urllib.parse import urlsplit

import httpx

ASK = [{"role": "user", "content": "Write about rivers and the sea."}]


class Bad(Exception):
    """The server did something the soak fails on (a 5xx, a truncated stream, a wrong answer)."""


@dataclass
class Run:
    base: str
    key: str
    model: str
    max_request_mib: int
    #: whether the server process has ended
    exited: Callable[[], bool] = lambda: False
    #: set once SIGTERM was sent: 503 server_shutting_down and refused connections are then expected
    stopping: bool = False
    ttfb: list[float] = field(default_factory=list)

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}", "x-api-key": self.key}


PROTOCOLS = {
    "chat": ("/v1/chat/completions", lambda r, n: {"messages": ASK, "max_tokens": n}),
    "completions": ("/v1/completions", lambda r, n: {"prompt": "Rivers and the sea:", "max_tokens": n}),
    "responses": ("/v1/responses", lambda r, n: {"model": r.model, "input": "Rivers and the sea.",
                                                  "max_output_tokens": n, "store": False}),
    "anthropic": ("/v1/messages", lambda r, n: {"model": "soak", "messages": ASK, "max_tokens": n}),
}
#: the event that ends each protocol's stream normally
ENDS = {"chat": "[DONE]", "completions": "[DONE]", "responses": ('"response.completed"', '"response.incomplete"'),
        "anthropic": '"message_stop"'}


def _refusal(run: Run, status: int, text: str) -> Optional[str]:
    """The outcome of a non-200 answer, or raise: 5xx fail the soak unless the server is stopping."""
    if status == 429 or status == 529:
        return "shed"
    if status == 503 and run.stopping and ("shut" in text or "retry-after: 5" in text.lower()):
        return "refused_while_draining"  # (a raw answer's body may be lost to the connection's close)
    if status >= 500:
        raise Bad(f"HTTP {status}: {text[:200]}")
    return None


def _ended_with_error(proto: str, text: str) -> bool:
    """A stream that ended with its protocol's terminal error event."""
    last = [line for line in text.splitlines() if line.startswith("data: ")][-1:]
    if not last:
        return False
    return '"error"' in last[0] or (proto == "responses" and '"response.failed"' in last[0])


async def stream(run: Run, client: httpx.AsyncClient, cut: bool = False) -> str:
    proto = random.choice(list(PROTOCOLS))
    path, body = PROTOCOLS[proto]
    started, text, first = time.monotonic(), "", None
    async with client.stream("POST", path, json={**body(run, random.randint(4, 48)), "stream": True},
                             headers=run.headers) as response:
        if response.status_code != 200:
            raw = (await response.aread()).decode(errors="replace")
            outcome = _refusal(run, response.status_code, raw)
            if outcome is None:
                raise Bad(f"{proto} stream: HTTP {response.status_code}: {raw[:200]}")
            return outcome
        async for chunk in response.aiter_text():
            text += chunk
            if first is None and "data: " in text:
                first = time.monotonic() - started
                run.ttfb.append(first)
            if cut and text.count("data: ") >= random.randint(1, 6):
                return "cut"  # leaving the block drops the connection mid-stream
    ends = ENDS[proto]
    if any(end in text for end in ((ends,) if isinstance(ends, str) else ends)):
        return "ok"
    if _ended_with_error(proto, text):
        if run.stopping or "request_queue_timeout" in text or "timeout_error" in text:
            return "stream_error_event"
        raise Bad(f"{proto} stream ended with an error event: {text[-300:]}")
    raise Bad(f"{proto} stream ended without its last event: {text[-300:]}")


async def aggregate(run: Run, client: httpx.AsyncClient) -> str:
    proto = random.choice(list(PROTOCOLS))
    path, body = PROTOCOLS[proto]
    response = await client.post(path, json=body(run, random.randint(4, 48)), headers=run.headers)
    if response.status_code == 200:
        json.loads(response.text)
        return "ok"
    outcome = _refusal(run, response.status_code, response.text)
    if outcome is None:
        raise Bad(f"{proto}: HTTP {response.status_code}: {response.text[:200]}")
    return outcome


async def garbage(run: Run, client: httpx.AsyncClient) -> str:
    path = random.choice([p for p, _ in PROTOCOLS.values()] + ["/tokenize", "/v1/messages/count_tokens"])
    payload = random.choice([random.randbytes(random.randint(1, 2000)), b"{", b'{"messages": 5}', b"[]",
                             json.dumps({"messages": [{"role": "nobody"}], "max_tokens": -3}).encode()])
    response = await client.post(path, content=payload, headers={**run.headers, "content-type": "application/json"})
    return _expect(run, response, (400, 404), "garbage")


async def oversize(run: Run, client: httpx.AsyncClient) -> str:
    path = random.choice([p for p, _ in PROTOCOLS.values()])
    body = b'{"messages": [{"role": "user", "content": "' + b"x" * (run.max_request_mib * 2 ** 20 + 1000) + b'"}]}'
    response = await client.post(path, content=body, headers={**run.headers, "content-type": "application/json"})
    return _expect(run, response, (413,), "oversize")


def _expect(run: Run, response: httpx.Response, statuses: tuple[int, ...], outcome: str) -> str:
    if response.status_code in statuses:
        return outcome
    refused = _refusal(run, response.status_code, response.text)
    if refused is not None:
        return refused
    raise Bad(f"{outcome}: HTTP {response.status_code}, expected {statuses}: {response.text[:200]}")


async def slow_body(run: Run, too_slow: bool) -> str:
    """A body over a raw connection, either too slow for the server's minimum rate (408) or just slow."""
    url = urlsplit(run.base)
    body = json.dumps({"messages": ASK, "max_tokens": 4, "user": "s" * 600}).encode()
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: {url.netloc}\r\nAuthorization: Bearer {run.key}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
    reader, writer = await asyncio.open_connection(url.hostname, url.port)
    answer = b""
    try:
        writer.write(head)
        step, pause = (1, 0.5) if too_slow else (200, 0.05)
        for i in range(0, len(body), step):
            writer.write(body[i:i + step])
            await writer.drain()
            try:  # the pause between pieces doubles as a look for an early answer (the 408)
                answer = await asyncio.wait_for(reader.read(65536), pause)
                break
            except asyncio.TimeoutError:
                continue
        if not answer:
            answer = await asyncio.wait_for(reader.read(65536), 60)
        if answer:  # the rest of the answer (the request said Connection: close)
            answer += await asyncio.wait_for(reader.read(), 10)
    except (ConnectionError, OSError):
        pass
    finally:
        writer.close()
    status = int(answer.split(b" ", 2)[1]) if answer.startswith(b"HTTP/1.1 ") else 0
    if status == 0 and run.stopping:
        return "connection_closed_while_stopping"
    if too_slow and status in (408, 0):
        return "slow_body_timed_out"
    if not too_slow and status == 200:
        return "slow_body_ok"
    refused = _refusal(run, status, answer.decode(errors="replace")) if status else None
    if refused is not None:
        return refused
    raise Bad(f"slow body ({'too slow' if too_slow else 'steady'}): {answer[:200]!r}")
