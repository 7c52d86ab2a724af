"""Responses server-sent events: named frames, numbered in order, one terminal event.

Each frame's ``event:`` name equals its JSON ``type``; ``sequence_number`` counts up
from 0 across the whole stream. Nothing is sent before the engine admits the request,
so a refusal at admission is still a plain HTTP error; a failure after that ends the
stream with ``response.failed``. There is no ``[DONE]`` sentinel. A refusal that comes
after a keep-alive comment has already sent the 200 (a queue timeout) is told as
``response.created`` then ``response.failed`` (:func:`early_failure`).
"""

from __future__ import annotations

from typing import Any, AsyncIterator, Awaitable, Callable

import msgspec
from loguru import logger

from ninfer.frontend.choice_output import ChoiceEvent
from ninfer.errors import NinferError
from ninfer.server.errors import INTERNAL_MESSAGE
from ninfer_plugins.protocols.openai_responses.output import Event
from ninfer_plugins.protocols.openai_responses.response import Turn

_encode = msgspec.json.Encoder().encode
#: stores the finished Response and returns it; raising fails the stream
Finalize = Callable[[], Awaitable[dict[str, Any]]]


class Framer:
    def __init__(self) -> None:
        self.sequence = 0

    def frame(self, event: Event) -> bytes:
        kind = event["type"]
        payload = {"type": kind, "sequence_number": self.sequence, **{k: v for k, v in event.items() if k != "type"}}
        self.sequence += 1
        return b"event: " + kind.encode() + b"\ndata: " + _encode(payload) + b"\n\n"


async def frames(turn: Turn, events: AsyncIterator[ChoiceEvent], finalize: Finalize) -> AsyncIterator[bytes]:
    """The whole stream; a ``finalize`` failure (a Response the store cannot hold) fails it too."""
    framer = Framer()
    started = False
    try:
        async for event in events:
            if not started:
                started = True
                yield framer.frame({"type": "response.created", "response": turn.response()})
                yield framer.frame({"type": "response.in_progress", "response": turn.response()})
            for semantic in turn.feed(event):
                yield framer.frame(semantic)
        final = await finalize()
    except Exception as exc:
        if not started:
            raise  # nothing sent yet: a plain HTTP error
        if not isinstance(exc, NinferError):
            logger.opt(exception=exc).error("Responses stream failed: unhandled {}", type(exc).__name__)
            exc = NinferError(INTERNAL_MESSAGE)
        yield framer.frame({"type": "response.failed", "response": turn.response(error=exc)})
        return
    yield framer.frame({"type": f"response.{final['status']}", "response": final})


def early_failure(turn: Turn, exc: NinferError) -> bytes:
    """The frames for a failure before ``response.created`` once the status is out: the
    stream's ``on_error``, so clients that expect the Response lifecycle get it."""
    framer = Framer()
    return (framer.frame({"type": "response.created", "response": turn.response()})
            + framer.frame({"type": "response.failed", "response": turn.response(error=exc)}))
