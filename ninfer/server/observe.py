"""Wiring the measurement surface onto a new server: /metrics always, the JSONL log when asked.

Done once, after the engine is built and before the server takes requests, so
server_start is the first line a server instance writes and no request can start
unobserved.
"""

from __future__ import annotations

import sys
from typing import Any, Optional, Sequence

from ninfer.server.metrics import ServerMetrics
from ninfer.server.request_log import RequestLog, RequestLogObserver
from ninfer.server.state import ServerState


def observe(state: ServerState, loaded: Any, argv: Optional[Sequence[str]] = None) -> None:
    """Give ``state`` its request observers and metrics registry; start the request log.

    ``loaded`` is the :class:`ninfer.engine.builder.LoadedEngine` (server_start reports
    it); ``argv`` defaults to the process's own. An unopenable log file raises ``OSError``
    (startup checks it first, see ninfer.profile.resolve).
    """
    metrics = ServerMetrics(state.model_id, state)
    observers: list[Any] = [metrics]
    path = state.profile.logging.request_log_jsonl
    if path is not None:
        log = RequestLogObserver(RequestLog(path), state)
        log.server_start(loaded, list(sys.argv if argv is None else argv))
        state.engine.on_interval = log.throughput  # the engine thread reads it at each interval
        observers.insert(0, log)
    state.observers, state.metrics = tuple(observers), metrics
