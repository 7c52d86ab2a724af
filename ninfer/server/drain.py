"""The drain after SIGTERM, step by step, until uvicorn may stop.

1. The caller has set ``gate.draining``: new generations get 503 ``server_shutting_down``
   in their protocol's shape and ``/health`` answers 503; the listener stays open so
   clients get that answer rather than a refused connection.
2. Running requests may finish for up to the drain bound (``--drain-timeout-ms``).
3. Then the engine fails what still runs (queued requests included) with
   ``server_shutting_down`` and the gate is cut, so requests still preparing fail as they
   reach the engine. Each request ends through its protocol's own error path: a stream
   with its terminal error event and a properly ended body, an aggregate request with 503.
4. The connections busy at that moment get :data:`CUT_GRACE_S` to finish; then a body still
   arriving is answered 503 and a client not reading its answer is disconnected
   (:func:`ninfer.server.connections.end_busy`). Whatever uvicorn would have to cancel
   after its own grace logs ``Exception in ASGI application``; this leaves it nothing.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from loguru import logger

from ninfer.errors import ServerShuttingDownError
from ninfer.server.admission import SHUT_DOWN_MESSAGE
from ninfer.server.connections import busy, end_busy

if TYPE_CHECKING:
    from ninfer.server.state import ServerState

#: after the drain bound, how long requests have to write their terminal error (and other
#: answers in progress to finish) before their connections are ended
CUT_GRACE_S = 5.0


async def drain(state: ServerState, connections: Any, bound_s: float) -> None:
    """Steps 2 to 4 above; returns when the server may stop."""
    gate, loop = state.gate, asyncio.get_running_loop()
    deadline = loop.time() + bound_s
    while gate.in_flight and loop.time() < deadline:
        await asyncio.sleep(0.1)
    if gate.in_flight:
        logger.warning("ending {} request(s) still running after {:g} s", gate.in_flight, bound_s)
        gate.cut = True
        state.engine.fail_requests(ServerShuttingDownError(SHUT_DOWN_MESSAGE))
    # Busy now: streams writing their last event, bodies still arriving, a client not
    # reading. Connections opened from here on are refused work and end by themselves.
    stuck = busy(connections)
    end = loop.time() + CUT_GRACE_S
    while (gate.in_flight or busy(stuck)) and loop.time() < end:
        await asyncio.sleep(0.05)
    ended = end_busy(stuck)
    if ended:
        logger.warning("ended {} connection(s) still busy {:g} s after the drain (a body still arriving, or a "
                       "client not reading its answer)", ended, CUT_GRACE_S)
