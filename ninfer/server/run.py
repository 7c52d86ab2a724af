"""``ninfer-serve``'s server process: listen, load the model, serve, drain on SIGTERM.

The listening socket is opened first and uvicorn answers from the start: until the
engine is built (in a background thread), ``/health`` says 503 and every other path
a 503 ``model_loading`` error. Connections go through
:class:`ninfer.server.connections.GuardedH11Protocol` (read deadlines, a connection cap).

The first SIGTERM (or Ctrl-C) drains: new generations get 503 in their protocol's
shape, running ones may finish for up to ``--drain-timeout-ms``, then they end with
their protocol's terminal error (:mod:`ninfer.server.drain`); logs are flushed and the
process exits 0. A second signal skips the wait. A signal while the model loads waits
for the load step under way to return (torch must not be torn down under it), shuts
down what it built and exits 0; a second one then exits 1 at once.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import threading
from functools import partial
from types import FrameType
from typing import Any, Optional

import uvicorn
from litestar import Litestar
from litestar.types import Receive, Scope, Send
from loguru import logger

from ninfer.engine.async_engine import AsyncEngine
from ninfer.engine.builder import build_engine
from ninfer.errors import ModelLoadingError
from ninfer.lora.config import LoraAdapterError
from ninfer.profile.resolve import auto_pool
from ninfer.profile.rules import lora_modules
from ninfer.server.admission import AdmissionGate, new_request_id
from ninfer.server.app import build_app
from ninfer.server.connections import (
    OVER_CAPACITY,
    ConnectionLimits,
    connection_counts,
    ensure_fd_limit,
    guarded_protocol,
    guarded_receive,
    refuse_connection,
)
from ninfer.server.core_routes import HEALTH_UNAVAILABLE
from ninfer.server.drain import drain
from ninfer.server.errors import send_error, send_json
from ninfer.server.middleware import REQUEST_ID_HEADER, RETRY_AFTER_HEADER
from ninfer.server.observe import observe
from ninfer.server.resources import CONNECTIONS_KEY
from ninfer.server.retry_after import retry_after
from ninfer.server.state import ServerState

#: the drain bound when there is no profile (tests); served: ``--drain-timeout-ms``
DRAIN_TIMEOUT_S = 30.0
#: after all that, how long uvicorn waits for connections before cancelling them
CANCEL_GRACE_S = 2
# A silent peer is probed after 5 s idle, every 5 s, 3 times; unacknowledged data
# fails the connection after 15 s. Accepted sockets inherit these on Linux.
KEEPALIVE_OPTIONS = (("TCP_KEEPIDLE", 5), ("TCP_KEEPINTVL", 5), ("TCP_KEEPCNT", 3), ("TCP_USER_TIMEOUT", 15_000))
_STDLIB_LEVELS = {"trace": logging.DEBUG, "debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
                  "error": logging.ERROR, "critical": logging.CRITICAL, "off": logging.CRITICAL}


def listen_socket(host: str, port: int, backlog: int = 2048) -> socket.socket:
    """A bound, listening TCP socket whose accepted connections use TCP keepalive."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                         flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for name, value in KEEPALIVE_OPTIONS:
            if hasattr(socket, name):  # Linux; elsewhere the system defaults stay
                sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)
        sock.bind(address)
        sock.listen(backlog)
    except BaseException:
        sock.close()
        raise
    return sock


class _ToLoguru(logging.Handler):
    """Stdlib records (uvicorn, Litestar, asyncio) into the one loguru sink."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            level: Any = logger.level(record.levelname).name
        except ValueError:
            level = record.levelno
        logger.opt(exception=record.exc_info).log(level, record.getMessage())


def route_stdlib_logging(level: str) -> None:
    """Send stdlib logging and Python warnings to loguru at the profile's level."""
    stdlib_level = _STDLIB_LEVELS[level]
    logging.basicConfig(handlers=[_ToLoguru()], level=stdlib_level, force=True)
    logging.captureWarnings(True)  # e.g. library deprecations, which would break the line format
    # uvicorn's lifecycle chatter repeats our own startup and shutdown lines.
    verbose = stdlib_level <= logging.DEBUG
    logging.getLogger("uvicorn").setLevel(stdlib_level if verbose else max(stdlib_level, logging.WARNING))


def display_url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


class ServerApp:
    """The ASGI app uvicorn runs: a loading placeholder, then the Litestar app."""

    def __init__(self, profile: Any, registry: Any, url: str):
        self.profile = profile
        self.registry = registry
        self.url = url
        self.app: Optional[Litestar] = None
        self.state: Optional[ServerState] = None
        self.server: Optional[uvicorn.Server] = None
        self.loop: Optional[asyncio.AbstractEventLoop] = None
        self.failed = False
        self.stopping = False
        self.loader: Optional[threading.Thread] = None
        #: the load was stopped (or its result discarded) by a shutdown
        self.load_interrupted = False
        self.drain_timeout_s = profile.server.drain_timeout_ms / 1000 if profile is not None else DRAIN_TIMEOUT_S
        self._drain_task: Optional[asyncio.Task] = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
        elif scope["type"] == "http" and scope.get("state", {}).get(OVER_CAPACITY):
            await refuse_connection(send)
        elif self.app is not None:
            if scope["type"] == "http":
                receive = guarded_receive(scope, receive)  # a body deadline raises into the handler
            await self.app(scope, receive, send)
        elif scope["type"] == "http":
            headers = [(REQUEST_ID_HEADER, new_request_id().encode())]
            if scope["path"] == "/health":
                wait = str(retry_after(503, ModelLoadingError.code)).encode()
                await send_json(send, 503, HEALTH_UNAVAILABLE, [*headers, (RETRY_AFTER_HEADER, wait)])
            else:
                await send_error(send, ModelLoadingError("the model is still loading; retry shortly"), headers)

    # -- lifespan --------------------------------------------------------------------
    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                self.loop = asyncio.get_running_loop()
                self.loader = threading.Thread(target=self._load, name="ninfer-load", daemon=True)
                self.loader.start()
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                self.stopping = True
                if self.loading:
                    # Returning now would finalize the interpreter under torch's threads (abort, exit 134).
                    await asyncio.to_thread(self.loader.join)
                    await asyncio.sleep(0)  # a _ready the loader queued runs (and discards its engine) first
                if self.state is not None:
                    await asyncio.to_thread(self.state.engine.shutdown)
                logger.info("server stopped" + ("; the model load was interrupted" if self.load_interrupted else ""))
                await logger.complete()  # every record written before the process exits
                await send({"type": "lifespan.shutdown.complete"})
                return

    @property
    def loading(self) -> bool:
        return self.loader is not None and self.loader.is_alive()

    def _load(self) -> None:
        """Build the engine and the app off the event loop, which keeps answering /health."""
        state: Optional[ServerState] = None
        try:
            state = build_state(self.profile, self.registry, stopping=self._stop_requested)
            app = build_app(state) if state is not None else None
        except Exception as exc:
            if state is not None:
                state.engine.shutdown()
            logger.error("cannot start the engine: {}: {}", type(exc).__name__, exc)
            logger.opt(exception=exc).debug("where the engine failed to start")
            self._call(self._fail)
            return
        if state is None:  # build_state saw the shutdown between its steps
            self.load_interrupted = True
        elif self._stop_requested() or not self._call(self._ready, state, app):
            self.load_interrupted = True
            state.engine.shutdown()

    def _stop_requested(self) -> bool:
        return self.stopping or (self.server is not None and self.server.should_exit)

    def _call(self, fn: Any, *args: Any) -> bool:
        """Run ``fn`` on the event loop; False once the server has already stopped."""
        try:
            self.loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed
            return False
        return True

    def _ready(self, state: ServerState, app: Litestar) -> None:
        if self._stop_requested():  # a signal came while loading
            self.load_interrupted = True
            state.engine.shutdown()
            return
        state.extras[CONNECTIONS_KEY] = partial(connection_counts, self.server.server_state.connections)
        self.state, self.app = state, app
        logger.info("server ready on {}", self.url)

    def _fail(self) -> None:
        self.failed = True
        self.server.should_exit = True

    # -- draining --------------------------------------------------------------------
    def on_signal(self, sig: int) -> None:
        """Called from the signal handler: hand over to the event loop."""
        if self.loop is None:
            self.server.should_exit = True
        else:
            self.loop.call_soon_threadsafe(self._begin_drain, signal.Signals(sig).name)

    def _begin_drain(self, signame: str) -> None:
        if self._drain_task is None and self.state is None and self.loading and not self.server.should_exit:
            logger.info("{}: shutting down while the model loads; stopping once the step under way returns "
                        "(a second signal exits at once)", signame)
        if self._drain_task is not None or self.state is None:  # a second signal, or nothing to drain
            self.server.should_exit = True
            return
        gate = self.state.gate
        gate.draining = True
        logger.info("{}: shutting down; waiting for {} request(s) in flight (at most {:g} s)",
                    signame, gate.in_flight, self.drain_timeout_s)
        self._drain_task = asyncio.get_running_loop().create_task(self._drain(self.state))

    async def _drain(self, state: ServerState) -> None:
        await drain(state, self.server.server_state.connections, self.drain_timeout_s)
        self.server.should_exit = True


class _Server(uvicorn.Server):
    """uvicorn, but a signal starts our drain and the process then exits 0.

    (uvicorn's own handler would stop listening at once and re-raise the signal after
    shutdown, which turns SIGTERM into a non-zero exit.)
    """

    def __init__(self, config: uvicorn.Config, app: ServerApp):
        super().__init__(config)
        self.ninfer_app = app

    def handle_exit(self, sig: int, frame: Optional[FrameType]) -> None:
        if self.should_exit and self.ninfer_app.loading:
            # nothing is served yet, and the load cannot be cut short: leave without finalizing
            logger.warning("{}: exiting without waiting for the model load", signal.Signals(sig).name)
            os._exit(1)
        if self.should_exit:
            self.force_exit = True
        else:
            self.ninfer_app.on_signal(sig)


def build_state(profile: Any, registry: Any, stopping: Any = lambda: False) -> Optional[ServerState]:
    """Load the model and start the engine thread: everything protocol routes need.

    None when ``stopping()`` turns true once the model is loaded (a shutdown came meanwhile).
    """
    loaded = build_engine(profile, registry)
    if stopping():  # nothing runs yet (no engine thread): dropping it frees it
        return None
    loras = lora_modules(profile.server.lora_modules or [])
    for name, path in loras.items():
        if name == loaded.model_id:
            raise LoraAdapterError(f"the LoRA adapter name {name!r} is the base model's id; choose another")
        loaded.engine.loras.load(name, path)  # raises LoraAdapterError naming the adapter and why
        logger.info("serving LoRA adapter {} from {}", name, path)
    engine = AsyncEngine(loaded.engine, stats_interval_s=profile.logging.stats_interval_ms / 1000)
    engine.start()
    gate = AdmissionGate(capacity=profile.engine.max_concurrency + profile.server.max_pending_requests,
                         pending_timeout_s=profile.server.pending_timeout_ms / 1000)
    state = ServerState(profile=profile, registry=registry, engine=engine, tokenizer=loaded.tokenizer,
                        family=loaded.family, model_id=loaded.model_id,
                        # no request outgrows the KV pool, so it bounds the advertised length too
                        max_model_len=min(profile.engine.max_context, loaded.engine.kv_capacity_tokens),
                        vocab_size=loaded.engine.vocab_size, gate=gate, loras=tuple(loras),
                        kv_capacity_tokens=loaded.engine.kv_capacity_tokens)
    observe(state, loaded)  # the request log (--request-log-jsonl) and the /metrics registry
    # what the startup summary could not know before loading
    how = f" (auto: {auto_pool(profile.engine, loaded.device.type)})" if profile.engine.kv_capacity == "auto" else ""
    logger.info("serving {} (max_model_len {}), KV pool {} tokens{}", state.model_id, state.max_model_len,
                state.kv_capacity_tokens, how)
    return state


def run(profile: Any, registry: Any) -> None:
    """Serve until a signal (exit 0) or a failed model load (``SystemExit(1)``)."""
    route_stdlib_logging(profile.logging.level)
    host, port = profile.server.host, profile.server.port
    try:
        sock = listen_socket(host, port)
    except OSError as exc:
        logger.error("cannot listen on {}: {}", display_url(host, port), exc)
        raise SystemExit(1) from None
    app = ServerApp(profile, registry, display_url(host, sock.getsockname()[1]))
    server_options = profile.server
    limits = ConnectionLimits(header_timeout_s=server_options.header_timeout_ms / 1000,
                              body_timeout_s=server_options.body_timeout_ms / 1000,
                              body_min_rate=server_options.body_min_rate,
                              max_connections=server_options.max_connections)
    warning = ensure_fd_limit(limits.max_connections)
    if warning:
        logger.warning(warning)
    # No limit_concurrency: its refusal is a plain-text 503 and counts only connections
    # that already sent a request; the guarded protocol caps connections instead.
    config = uvicorn.Config(app, lifespan="on", log_config=None, access_log=False, proxy_headers=False,
                            server_header=False, ws="none", timeout_graceful_shutdown=CANCEL_GRACE_S,
                            http=guarded_protocol(limits),
                            timeout_keep_alive=server_options.keep_alive_timeout_ms / 1000)  # type: ignore[arg-type]
    server = _Server(config, app)
    app.server = server
    logger.info("listening on {} while the model loads", app.url)
    server.run(sockets=[sock])
    if app.failed:
        raise SystemExit(1)
