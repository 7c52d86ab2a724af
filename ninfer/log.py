"""Operational logging: one loguru sink on stderr.

Records look like ``2026-11-29 12:00:00.123 INFO server ready``. Colour is used only
when stderr is a terminal, so redirected logs hold no control sequences. The rest of
ninfer logs with ``from loguru import logger`` and never configures sinks itself.
"""

from __future__ import annotations

import sys

from loguru import logger

#: profile ``logging.level`` values -> loguru level names ("off" has none)
LEVELS = {
    "trace": "TRACE",
    "debug": "DEBUG",
    "info": "INFO",
    "warning": "WARNING",
    "error": "ERROR",
    "critical": "CRITICAL",
}
# Colour markup is stripped by loguru when colorize is False.
FORMAT = "<green>{time:YYYY-MM-DD HH:mm:ss.SSS}</green> <level>{level}</level> {message}"


def setup_logging(level: str) -> None:
    """Send records at ``level`` and above to stderr; ``"off"`` silences everything."""
    if level != "off" and level not in LEVELS:
        raise ValueError(f"unknown log level {level!r}; expected one of {', '.join([*LEVELS, 'off'])}")
    logger.remove()
    if level == "off":
        return
    stream = sys.stderr
    # diagnose=False: tracebacks must not print local variables (prompts, keys).
    logger.add(stream, level=LEVELS[level], format=FORMAT, colorize=stream.isatty(), backtrace=False,
               diagnose=False)
