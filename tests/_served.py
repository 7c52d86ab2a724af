"""A real engine and server app in this process: for states a subprocess cannot be put in
(faults injected by monkeypatching, the drain's cut) and for enumerating the app's routes."""

from __future__ import annotations

from typing import Any

import httpx

from ninfer.cli.serve import build_parser
from ninfer.plugins import load_registry
from ninfer.profile import load_profile, resolve
from ninfer.profile.flags import overrides_from_args
from ninfer.server.run import build_state
from ninfer.server.state import ServerState


def served_state(model: Any, *flags: str) -> ServerState:
    """The state ``ninfer-serve MODEL --device cpu FLAGS`` builds (its engine thread running:
    call ``state.engine.shutdown()`` when done)."""
    args = build_parser().parse_args(["--model", str(model), "--device", "cpu", *flags])
    profile = resolve(load_profile(args.profile, args.model, overrides_from_args(args)))
    return build_state(profile, load_registry(profile.plugins.allow))


async def call(app: Any, method: str, path: str, **kw: Any) -> httpx.Response:
    """One request to the ASGI ``app`` (the whole answer, streams included, read at once)."""
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
        return await client.request(method, path, **kw)
