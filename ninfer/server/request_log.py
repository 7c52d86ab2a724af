"""``--request-log-jsonl FILE``: the machine-readable measurement log, one JSON object per line.

Every line carries the schema name and version, the event name, a wall-clock
``timestamp_unix_ms`` and this process's ``server_instance_id`` (several runs may append
to one campaign file). The file is opened for appending and every event is written and
flushed at once, under a lock: events come from the event loop (requests) and the
engine thread (throughput). A line is small and goes to the page cache, so the write
does not hold the event loop up in practice; nothing is fsynced.

The JSON Schema of the lines is ``request_log.schema.json`` beside this module; docs/server.md
describes every event and field.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Optional

from loguru import logger

from ninfer.engine.stats import ContextCacheCounters, IntervalStats
from ninfer.frontend.lifecycle import Rejection
from ninfer.frontend.pipeline import Run
from ninfer.server import engine_records, request_records

SCHEMA = "ninfer_serve_request_log"
SCHEMA_VERSION = 2
SCHEMA_PATH = Path(__file__).with_name("request_log.schema.json")


class RequestLog:
    """The open log file; :meth:`write` appends one event."""

    def __init__(self, path: str):
        # line-buffered text would flush per newline too; the explicit flush says it
        self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115 - open for the process's life
        self._lock = threading.Lock()
        self.path = path
        self.server_instance_id = uuid.uuid4().hex
        self._failed = False

    def write(self, event: str, fields: dict[str, Any]) -> None:
        record = {"schema": SCHEMA, "schema_version": SCHEMA_VERSION, "event": event,
                  "timestamp_unix_ms": time.time_ns() // 1_000_000, "server_instance_id": self.server_instance_id,
                  **fields}
        line = json.dumps(record, ensure_ascii=False, allow_nan=False, separators=(",", ":")) + "\n"
        try:
            with self._lock:
                self._file.write(line)
                self._file.flush()
        except OSError as exc:  # a full disk must not fail requests; say it once
            if not self._failed:
                self._failed = True
                logger.error("the request log {} cannot be written: {}", self.path, exc)

    def close(self) -> None:
        with self._lock:
            self._file.close()


class RequestLogObserver:
    """Writes the request events of :mod:`ninfer.frontend.lifecycle` and the engine's
    throughput intervals to a :class:`RequestLog`."""

    def __init__(self, log: RequestLog, state: Any):
        self.log = log
        self.state = state
        profile = state.profile
        self._backend: Optional[str] = profile.speculative.backend
        self._window = profile.speculative.draft_tokens or 0
        self._seq = 0  # request sequence numbers, monotonic within this server instance
        self._seqs: dict[int, int] = {}  # id(run) -> its number, from start to terminal

    def _next(self) -> int:
        self._seq += 1  # only ever called on the event loop
        return self._seq

    def _ids(self, request_id: str, seq: int) -> dict[str, Any]:
        return {"request_id": request_id, "request_seq": seq}

    def rejected(self, rejection: Rejection) -> None:
        fields = request_records.rejected_fields(rejection)
        self.log.write("request_rejected", {**self._ids(rejection.request_id, self._next()), **fields})

    def started(self, run: Run) -> None:
        seq = self._seqs[id(run)] = self._next()
        e = self.state.profile.engine
        fields = request_records.start_fields(run, e.default_max_tokens, self.state.max_model_len)
        self.log.write("request_start", {**self._ids(_http_id(run), seq), **fields})

    def ended(self, run: Run) -> None:
        seq = self._seqs.pop(id(run), 0)
        fields = request_records.outcome_fields(run, self._backend, self._window)
        life = run.life
        assert life is not None
        if life.failure is None and run.finished:
            self.log.write("request_done", {**self._ids(_http_id(run), seq), **fields})
            return
        code = life.ticket.error_code if life.ticket is not None else None
        terminal = request_records.error_terminal_fields(run, code)
        self.log.write("request_error", {**self._ids(_http_id(run), seq), **terminal, **fields})

    def throughput(self, s: IntervalStats, before: ContextCacheCounters, now: ContextCacheCounters) -> None:
        """The async engine's interval hook (engine thread)."""
        fields = engine_records.throughput_fields(s, self.state.engine.engine, before, now, self.state.gate.in_flight)
        self.log.write("throughput", fields)

    def server_start(self, loaded: Any, argv: list[str]) -> None:
        self.log.write("server_start", engine_records.server_start_fields(self.state, loaded, argv))


def _http_id(run: Run) -> str:
    """The id the client saw in ``x-request-id`` (the run's own id outside HTTP)."""
    ticket = run.life.ticket if run.life is not None else None
    return ticket.request_id if ticket is not None else run.request_id
