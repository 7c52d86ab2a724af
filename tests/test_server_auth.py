"""With --api-key, every route and method of the real app needs the key but GET /health,
HEAD / and CORS preflights: enumerated from the app itself, so a new route cannot slip by."""

from __future__ import annotations

import asyncio
import re

import pytest
from _served import call, served_state

from ninfer.server.app import build_app
from ninfer.server.middleware import OPEN_ROUTES

KEY = "auth-key"
PREFLIGHT = {"origin": "https://example.com", "access-control-request-method": "POST"}


@pytest.fixture(scope="module", params=[False, True], ids=["no-cors", "cors"])
def app(request, tiny_qwen3):
    state = served_state(tiny_qwen3, "--api-key", KEY, *(["--cors"] if request.param else []))
    yield build_app(state)
    state.engine.shutdown()


def _routes(app) -> list[tuple[str, str]]:
    """(method, concrete path) of every route the app serves, path parameters filled in."""
    return [(method, re.sub(r"\{[^}]+\}", "x", route.path)) for route in app.routes for method in sorted(route.methods)]


def test_only_health_head_root_and_preflights_are_open(app):
    assert OPEN_ROUTES == {("GET", "/health"), ("HEAD", "/")}
    routes = _routes(app)
    assert ("GET", "/") in routes and ("OPTIONS", "/v1/messages") in routes and len(routes) > 30

    async def main():
        for method, path in routes:
            anonymous = await call(app, method, path, headers={"content-type": "application/json"})
            if (method, path) in OPEN_ROUTES:
                assert anonymous.status_code == 200, (method, path)
                continue
            assert anonymous.status_code == 401, (method, path, anonymous.status_code, anonymous.text[:200])
            keyed = await call(app, method, path, headers={"x-api-key": KEY, "content-type": "application/json"})
            assert keyed.status_code != 401, (method, path)
        for path in {path for _, path in routes}:
            preflight = await call(app, "OPTIONS", path, headers=PREFLIGHT)
            assert preflight.status_code in (200, 204), (path, preflight.status_code)
            assert "authentication" not in preflight.text

    asyncio.run(main())


def test_what_an_anonymous_caller_learns(app):
    async def main():
        head = await call(app, "HEAD", "/")
        assert head.status_code == 200 and head.content == b""
        plain_options = await call(app, "OPTIONS", "/v1/chat/completions")
        assert plain_options.status_code == 401 and "allow" not in plain_options.headers
        root = await call(app, "GET", "/")
        assert root.status_code == 401 and "version" not in root.text

    asyncio.run(main())
