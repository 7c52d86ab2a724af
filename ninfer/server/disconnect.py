"""Cancel work when the client hangs up, for handlers that answer with one JSON body.

Litestar (2.x) keeps running a handler after its client has gone; only streaming
responses watch the connection. Once the request body has been read, the ASGI
``receive`` channel has nothing left to deliver but ``http.disconnect``, so a task
waiting on it learns of the hang-up while the handler works.
"""

from __future__ import annotations

import asyncio
from typing import Awaitable, TypeVar

from litestar import Request
from litestar.types import Receive

from ninfer.errors import RequestAbortedError
from ninfer.server.admission import current_ticket

T = TypeVar("T")


async def wait_for_disconnect(receive: Receive) -> None:
    """Return once the client has disconnected; unread body chunks are discarded.

    The current request's ticket is marked, so the request log says why it ended.
    """
    while (await receive())["type"] != "http.disconnect":
        pass
    ticket = current_ticket()
    if ticket is not None:
        ticket.disconnected = True


async def cancel_on_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await ``work``; if the client disconnects first, cancel it and raise 499.

    Cancelling a generation that iterates ``ServerState.generate`` closes the stream,
    which aborts the engine request and frees its KV pages.
    """
    await request.body()  # fully read (and cached), so receive() now only reports the hang-up
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_for_disconnect(request.receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():  # the client left, or this handler itself is being cancelled
            task.cancel()
            await asyncio.wait({task})  # let the work's cleanup (the engine abort) run first
    if task.cancelled():
        raise RequestAbortedError("the client disconnected before the response was ready")
    return task.result()
