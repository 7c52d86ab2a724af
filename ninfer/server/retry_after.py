"""How long a refused client should wait before trying again: the ``Retry-After`` header.

Every 429 and 503 carries one, in whole seconds, whichever protocol renders the body
(Anthropic's 529 and 504 are the same refusals and carry it too). The value depends on
why the request was refused, so it is looked up by error code first.
"""

from __future__ import annotations

from typing import Optional

HEADER = "retry-after"

SECONDS_BY_CODE = {
    # every slot is taken: one frees as soon as any running or waiting request ends
    "server_overloaded": 1,
    # the engine stayed busy for the whole pending timeout: back off a little longer
    "request_queue_timeout": 2,
    # the model loads in seconds to minutes; polling faster only adds load
    "model_loading": 5,
    # draining before exit: a restarted or replacement server needs a few seconds to listen
    "server_shutting_down": 5,
    # the engine failed as a whole: only a restart (and a model load) brings it back
    "engine_unavailable": 30,
}
#: a 429 or 503 whose cause was not recorded (a plugin's own response): the same values
SECONDS_BY_STATUS = {429: SECONDS_BY_CODE["server_overloaded"], 503: SECONDS_BY_CODE["server_shutting_down"]}


def retry_after(status: int, code: Optional[str] = None) -> Optional[int]:
    """Seconds to send with an error response of ``status`` and ``code``; None when a retry cannot help."""
    if status < 400:
        return None
    if code in SECONDS_BY_CODE:
        return SECONDS_BY_CODE[code]
    return SECONDS_BY_STATUS.get(status)
