"""``GET /health/resources``: what the server holds right now, for leak checks.

Capacity slots, engine requests, KV pages, recurrent-state slots and open connections,
as plain counts. With no request in flight every one of them but the connections and
the prefix cache's pages must be back at zero: ``scripts/soak`` checks exactly that after
its run, and an operator can too. Pages the prefix cache keeps are free (reusable, evicted
when needed), so they are reported apart from the used ones. It shows internals, so it
needs the API key when one is set (it is not one of the open routes). The engine thread
updates plain ints, so reading them here needs no lock; a read during a step may be one
step stale, never torn.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Optional

import msgspec
from litestar import get

from ninfer.server.openapi import error_responses, json_response

if TYPE_CHECKING:
    from ninfer.server.state import ServerState

#: ``ServerState.extras`` key of a function returning ``(open, busy)`` connection counts (set
#: by ninfer.server.run; absent in-process, where there is no listening server)
CONNECTIONS_KEY = "server.connections"


class Slots(msgspec.Struct):
    used: int
    total: int


class KvPages(msgspec.Struct):
    used: int
    #: free pages still holding reusable prefixes
    cached: int
    total: int


class Connections(msgspec.Struct):
    open: int
    #: answering a request (the rest wait for their client)
    busy: int


class Resources(msgspec.Struct):
    alive: bool
    draining: bool
    #: HTTP generation requests holding a capacity slot (--max-concurrency + --max-pending-requests)
    requests: Slots
    engine_running: int
    engine_waiting: int
    kv_pages: KvPages
    #: recurrent-state rows of running requests (hybrid families; 0 of 0 otherwise)
    state_slots: Slots
    connections: Optional[Connections]


def resources(state: ServerState) -> Resources:
    engine = state.engine.engine
    sched, bm = engine.scheduler, engine.block_manager
    slots = sched.state_slots
    count: Optional[Callable[[], tuple[int, int]]] = state.extras.get(CONNECTIONS_KEY)
    return Resources(
        alive=state.engine.alive,
        draining=state.gate.draining,
        requests=Slots(state.gate.in_flight, state.gate.capacity),
        engine_running=sched.num_running,
        engine_waiting=sched.num_waiting,
        kv_pages=KvPages(bm.num_used_blocks, bm.num_cached_blocks, bm.num_blocks),
        state_slots=Slots(slots.num_used, slots.num_used + slots.num_free) if slots is not None else Slots(0, 0),
        connections=Connections(*count()) if count is not None else None,
    )


def resource_routes(state: ServerState) -> list[Any]:
    @get("/health/resources", summary="What the server holds now", tags=["server"], sync_to_thread=False,
         responses={200: json_response(Resources, "Slots, engine requests, KV pages, state slots, connections"),
                    **error_responses(500)})
    def held() -> Resources:
        return resources(state)

    return [held]
