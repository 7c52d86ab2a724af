"""Run a real ``ninfer-serve`` process for tests, on a free port, and always stop it.

One server for a block of code::

    from server_harness import running_server

    def test_models():
        with running_server("--api-key", "k") as base_url:
            httpx.get(f"{base_url}/v1/models", headers={"x-api-key": "k"})

One server shared by a module (the fixture takes the variable's name)::

    from server_harness import server_fixture

    server = server_fixture("--max-context", "512")

    def test_health(server):
        assert httpx.get(f"{server}/health").status_code == 200

The yielded base URL is a ``str`` that also carries ``.process`` (the ``Popen``) and
``.logs()`` (the server's stderr so far). The model defaults to ``tiny:qwen3``, built
in the session's ``NINFER_CACHE_DIR`` (tests/conftest.py sets it); ``--device cpu`` is
passed first, so a later ``--device`` flag wins, while ``--host``/``--port`` are always
the harness's (127.0.0.1 and a free port). Startup waits for ``/health`` to say 200;
stopping sends SIGTERM, then SIGKILL if the process outlives the timeout. For full
control (signals, exit codes) use :func:`start_server` and :func:`stop_server`.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator, Optional

import httpx
import pytest

SERVE = Path(sys.executable).with_name("ninfer-serve")
READY_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 40.0  # above the server's own 30 s drain bound


class BaseURL(str):
    """``http://127.0.0.1:PORT`` plus the process behind it."""

    process: subprocess.Popen
    log_path: Path

    def logs(self) -> str:
        return self.log_path.read_text(errors="replace")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(*flags: str, model: str = "tiny:qwen3", env: Optional[dict[str, str]] = None,
                 ready_timeout: float = READY_TIMEOUT_S) -> BaseURL:
    """Start a server and wait until it is ready; the caller must :func:`stop_server` it."""
    for _ in range(3):  # another process may grab the free port before the server binds it
        port = free_port()
        log = Path(tempfile.mkstemp(prefix="ninfer-serve-", suffix=".log")[1])
        with log.open("wb") as sink:
            process = subprocess.Popen(
                [str(SERVE), model, "--device", "cpu", *flags, "--host", "127.0.0.1", "--port", str(port)],
                stdout=sink, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
            )
        url = BaseURL(f"http://127.0.0.1:{port}")
        url.process, url.log_path = process, log
        try:
            if _wait_ready(url, ready_timeout):
                return url
        except BaseException:
            stop_server(url)
            raise
        if "cannot listen" not in url.logs():
            output = url.logs()
            stop_server(url)
            raise RuntimeError(f"ninfer-serve exited with {process.returncode}:\n{output}")
        stop_server(url)
    raise RuntimeError("ninfer-serve found no free port")


def _wait_ready(url: BaseURL, timeout: float) -> bool:
    """True once /health answers 200; False if the process exits first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if url.process.poll() is not None:
            return False
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return True
        time.sleep(0.1)
    raise TimeoutError(f"ninfer-serve was not ready within {timeout:.0f} s:\n{url.logs()}")


def stop_server(url: BaseURL, timeout: float = STOP_TIMEOUT_S) -> int:
    """SIGTERM, wait, SIGKILL if needed; returns the exit code. Removes the log file."""
    process = url.process
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)
    with contextlib.suppress(FileNotFoundError):
        url.log_path.unlink()
    return process.returncode


@contextlib.contextmanager
def running_server(*flags: str, model: str = "tiny:qwen3", env: Optional[dict[str, str]] = None,
                   ready_timeout: float = READY_TIMEOUT_S) -> Iterator[BaseURL]:
    url = start_server(*flags, model=model, env=env, ready_timeout=ready_timeout)
    try:
        yield url
    finally:
        stop_server(url)


def server_fixture(*flags: str, scope: str = "module", model: str = "tiny:qwen3",
                   env: Optional[dict[str, str]] = None):
    """A pytest fixture running one server with ``flags`` for the given scope."""

    @pytest.fixture(scope=scope)
    def server() -> Iterator[BaseURL]:
        with running_server(*flags, model=model, env=env) as url:
            yield url

    return server
