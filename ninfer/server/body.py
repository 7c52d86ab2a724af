"""Request bodies: read by the handler, decoded strictly, and off the event loop when large.

Handlers take the raw body instead of a Litestar ``data`` parameter for two reasons.
Litestar decodes leniently (``"5"`` becomes 5, ``1`` becomes true), where OpenAI
rejects both and a client sending them has a bug worth surfacing: msgspec decodes with
``strict`` types, a float field still taking an integer, and a mismatch is a 400 naming
the field (:func:`ninfer.server.errors.handle_decode_error`). And Litestar would decode
on the event loop: a 20 MB body of small messages takes seconds to decode and check,
during which /health and every other stream would stall, so :func:`parse_body` runs a
large body's decoding and checks in a worker thread. Routes document the body they
decode with :func:`ninfer.server.openapi.body_operation`.
"""

from __future__ import annotations

import asyncio
from typing import Callable, TypeVar

from litestar import Request

from ninfer.errors import InvalidRequestError

T = TypeVar("T")

#: bodies from this size on are parsed in a worker thread; smaller ones cost less than the hop
OFF_LOOP_BYTES = 1 << 20


async def parse_body(request: Request, parse: Callable[[bytes], T]) -> T:
    """``parse(body)``: the protocol's decoding and checks, off the event loop for a large body."""
    body = await request.body()
    if len(body) < OFF_LOOP_BYTES:
        return _bounded(parse, body)
    return await asyncio.to_thread(_bounded, parse, body)


def _bounded(parse: Callable[[bytes], T], body: bytes) -> T:
    """A body nested deeper than the decoder's recursion limit is the client's mistake: a 400."""
    try:
        return parse(body)
    except RecursionError:
        raise InvalidRequestError("the request body's JSON nests too deeply to decode") from None
