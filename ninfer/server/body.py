"""Strict request bodies: JSON types are checked as sent, with no coercion.

A handler's ``data`` parameter documents the body in the OpenAPI schema, but Litestar
decodes it leniently: ``"5"`` becomes 5, ``5.0`` becomes 5 and ``1`` becomes true.
OpenAI rejects all three, and a client sending them has a bug worth surfacing, so
protocols re-check the same parsed JSON (Litestar caches it) with :func:`strict_body`:
integers must be JSON integers, booleans JSON booleans, strings JSON strings; a float
field still takes an integer. A mismatch is a 400 naming the field (see
:func:`ninfer.server.errors.handle_decode_error`).
"""

from __future__ import annotations

from typing import TypeVar

import msgspec
from litestar import Request

T = TypeVar("T")


async def strict_body(request: Request, type_: type[T]) -> T:
    """The request's JSON body as ``type_``; raises ``msgspec.ValidationError`` on a wrong type."""
    return msgspec.convert(await request.json(), type_, strict=True)
