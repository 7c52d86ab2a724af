"""The Litestar application: core routes plus the routes of each selected protocol plugin."""

from __future__ import annotations

from typing import Any

from litestar import Litestar, Request, Response, Router
from litestar.config.cors import CORSConfig
from litestar.exceptions import HTTPException
from litestar.openapi import OpenAPIConfig

from ninfer import __version__
from ninfer.server.core_routes import core_routes
from ninfer.server.errors import EXCEPTION_HANDLERS, MIB
from ninfer.server.middleware import (
    CORE_PROTOCOL,
    PROTOCOL_OPT,
    RequestMiddleware,
    api_key_guard,
    is_open,
    record_error,
)
from ninfer.server.metrics import metrics_route
from ninfer.server.openapi import ERROR_SHAPE_OPT, ErrorResponse, error_responses
from ninfer.server.resources import resource_routes
from ninfer.server.state import ServerState


def protocol_routers(state: ServerState) -> list[Router]:
    """One router per protocol named by ``server.protocols`` (None: every installed one).

    The router tags its routes with the protocol's name, which the request log reports.
    """
    names = state.profile.server.protocols
    if names is None:
        protocols = state.registry.all("protocol")
    else:
        protocols = [state.registry.get("protocol", name, key="server.protocols") for name in names]
    return [_router(state, p.routes(state), p.name) for p in protocols if p.routes is not None]


def _router(state: ServerState, handlers: list, protocol: str) -> Router:
    if state.profile.server.api_key:
        # Every route but the open ones can then answer the key guard's 401.
        for handler in handlers:
            if not all(is_open(method, handler.paths) for method in handler.http_methods):
                shape = handler.opt.get(ERROR_SHAPE_OPT, ErrorResponse)  # the guard's 401 is rendered in it
                handler.responses = {**error_responses(401, container=shape), **(handler.responses or {})}
    return Router(path="/", route_handlers=handlers, opt={PROTOCOL_OPT: protocol})


def _metrics_router(state: ServerState) -> list[Router]:
    """``GET /metrics`` when the state has a registry (a server built by ninfer.server.run has)."""
    if state.metrics is None:
        return []
    return [_router(state, [metrics_route(state.metrics)], CORE_PROTOCOL)]


def routing_error_handlers(routers: list[Router]) -> dict:
    """The app's exception handlers, with Litestar's own errors under a protocol's path
    rendered in that protocol's shape.

    A wrong method or an unknown sub-path (``GET /v1/messages``, ``POST /v1/messages/batches``)
    fails while routing, before any route's handlers apply; a route that answers errors its
    own way (Anthropic's) claims its path and everything below it.
    """
    owners: list[tuple[str, Any]] = []
    for router in routers:
        for route in router.routes:
            for handler in route.route_handlers:
                own = (handler.exception_handlers or {}).get(HTTPException)
                if own is not None and "{" not in route.path:
                    owners.append((route.path.rstrip("/"), own))
    if not owners:
        return EXCEPTION_HANDLERS
    core = EXCEPTION_HANDLERS[HTTPException]

    def handle_http_exception(request: Request, exc: HTTPException) -> Response:
        path = request.url.path.rstrip("/")
        for prefix, own in owners:
            if path == prefix or path.startswith(prefix + "/"):
                return own(request, exc)
        return core(request, exc)

    return {**EXCEPTION_HANDLERS, HTTPException: handle_http_exception}


def build_app(state: ServerState) -> Litestar:
    server = state.profile.server
    cors = None
    if server.cors:
        cors = CORSConfig(allow_origins=["*"], allow_methods=["*"], allow_headers=["*"],
                          expose_headers=["x-request-id", "request-id"])
    protocols = protocol_routers(state)
    app = Litestar(
        route_handlers=[_router(state, [*core_routes(state), *resource_routes(state)], CORE_PROTOCOL),
                        *protocols,
                        *_metrics_router(state)],
        # App-wide, so it covers the OpenAPI document too; a guard runs after routing, so its
        # 401 is rendered by the route's own exception handlers (Anthropic's shape on /v1/messages).
        guards=[api_key_guard(server.api_key)] if server.api_key else None,
        exception_handlers=routing_error_handlers(protocols),
        after_exception=[record_error],  # for Retry-After and the request log, in every protocol
        cors_config=cors,
        openapi_config=OpenAPIConfig(title="ninfer", version=__version__,
                                     description=f"Serving {state.model_id} over OpenAI- and Anthropic-style APIs."),
        # Litestar checks Content-Length up front and counts streamed bytes, before any parsing.
        request_max_body_size=server.max_request_mib * MIB,
        logging_config=None,  # stdlib records are routed into loguru by ninfer.server.run
    )
    # Outermost, so unknown paths, CORS preflights and routing errors get a request id too.
    app.asgi_handler = RequestMiddleware(app.asgi_handler)
    return app
