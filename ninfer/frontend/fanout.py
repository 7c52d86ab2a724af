"""Run the engine requests of one HTTP request (``n`` choices) and interleave their events."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, AsyncIterator, Sequence

from ninfer.engine.request import EngineRequest, GenerationEvent

if TYPE_CHECKING:
    from ninfer.frontend.host import ServingHost

_DONE = object()


async def generate_all(host: ServingHost, requests: Sequence[EngineRequest]) -> AsyncIterator[tuple[int, GenerationEvent]]:
    """``(choice index, event)`` in arrival order; closing this aborts every request.

    The first failure of any request (a refusal at admission included) is raised here
    and ends the whole answer; the other requests are aborted.
    """
    streams = [host.generate(r) for r in requests]
    if len(streams) == 1:
        try:
            async for event in streams[0]:
                yield 0, event
        finally:
            await streams[0].aclose()
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[GenerationEvent]) -> None:
        try:
            async for event in stream:
                queue.put_nowait((index, event))
        except Exception as exc:  # handed to the consumer, which raises it
            queue.put_nowait((index, exc))
        finally:
            queue.put_nowait((index, _DONE))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        running = len(tasks)
        while running:
            index, item = await queue.get()
            if item is _DONE:
                running -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()  # cancelling a pump unwinds its engine stream, which aborts the request
        await asyncio.gather(*tasks, return_exceptions=True)
        for stream in streams:
            await stream.aclose()
