"""Schemathesis hooks for fuzzing a live server: short generations, real stored ids, a tally.

- :func:`tame` (``map_body``) keeps generations short on CPU: output limits capped, few
  choices, and a ``model`` the server serves where the protocol requires one (a wrong
  one is a plain 404, which the fuzzer would otherwise hit on nearly every case).
- :class:`StoredIds` (``map_path_parameters`` / ``after_call``) feeds the ids of Responses that
  really are stored to the routes taking ``{response_id}`` (and the served model's id to
  ``{model_id}``) on every other call, so the paths past the 404 are exercised too.
- :class:`Tally` counts the cases by operation and status, for the report.
"""

from __future__ import annotations

import collections
import itertools
from typing import Any

import httpx

MAX_TOKENS = 4
_LIMITS = ("max_tokens", "max_completion_tokens", "max_output_tokens")


def tame(model: str):
    """The ``map_body`` hook for a server serving ``model``."""

    def hook(ctx: Any, body: Any) -> Any:
        if not isinstance(body, dict):
            return body
        path = ctx.operation.path if ctx.operation is not None else ""
        if path in ("/v1/responses", "/v1/responses/input_tokens"):
            if "model" in body:
                body["model"] = model
        elif path != "/v1/messages" and path != "/v1/messages/count_tokens":
            body.pop("model", None)  # optional on the OpenAI-style routes: omitted means the served model
        for name in _LIMITS:
            if isinstance(body.get(name), int) and not isinstance(body[name], bool):
                body[name] = max(-1, min(body[name], MAX_TOKENS))
        if isinstance(body.get("n"), int) and not isinstance(body["n"], bool):
            body["n"] = min(body["n"], 2)
        return body

    return hook


class StoredIds:
    """Ids of stored Responses, handed to every other ``{response_id}`` case."""

    def __init__(self, base: str, headers: dict[str, str], model: str, count: int = 8):
        self.model = model
        self.ids: list[str] = []
        for i in range(count):
            response = httpx.post(f"{base}/v1/responses", headers=headers, timeout=60,
                                  json={"model": model, "input": f"fuzz seed {i}", "max_output_tokens": 2})
            response.raise_for_status()
            self.ids.append(response.json()["id"])
        self._turn = itertools.count()

    def map_path_parameters(self, ctx: Any, params: Any) -> Any:
        if not isinstance(params, dict):
            return params
        turn = next(self._turn)
        if turn % 2:
            return params
        if "response_id" in params and self.ids:
            params["response_id"] = self.ids[(turn // 2) % len(self.ids)]
        if "model_id" in params:
            params["model_id"] = self.model
        return params

    def after_call(self, ctx: Any, case: Any, response: Any) -> None:
        """Keep the pool full: stored Responses created by the fuzzer join it, deleted ones leave."""
        if case.operation.path == "/v1/responses" and case.method == "POST" and response.status_code == 200:
            if response.headers.get("content-type", [""])[0].startswith("application/json"):
                self.ids.append(response.json()["id"])
        if case.method == "DELETE" and response.status_code == 200:
            gone = (case.path_parameters or {}).get("response_id")
            if gone in self.ids and len(self.ids) > 1:
                self.ids.remove(gone)


class Tally:
    def __init__(self) -> None:
        self.cases: collections.Counter[tuple[str, int]] = collections.Counter()

    def after_call(self, ctx: Any, case: Any, response: Any) -> None:
        self.cases[(f"{case.method} {case.operation.path}", response.status_code)] += 1

    def report(self) -> str:
        total = sum(self.cases.values())
        by_op: dict[str, dict[int, int]] = collections.defaultdict(dict)
        for (op, status), n in sorted(self.cases.items()):
            by_op[op][status] = n
        lines = [f"{total} cases"]
        lines += [f"  {op}: {sum(s.values())} ({', '.join(f'{k}: {v}' for k, v in s.items())})"
                  for op, s in by_op.items()]
        return "\n".join(lines)
