"""Server-sent events shared by every protocol: keep-alives, late headers, sure cleanup.

A handler returns ``sse_response(frames)`` where ``frames`` yields complete SSE frames
(``"data: ...\\n\\n"``, with ``event:`` lines if the protocol uses them). The response

- sends ``: keep-alive`` after ``keepalive_s`` without a frame, also before the first one
  (while the request waits for admission or prefills), so dead peers surface; a protocol
  may name its own idle frame (``keepalive_frame``, Anthropic's ``ping`` event), sent
  only once its first frame is out: a protocol event before the stream's opening one
  would break the protocol's event order;
- sends the status line only with the first frame or keep-alive: an error the frames
  raise before that becomes an ordinary HTTP error (429, 400, ...) through the route's
  exception handlers; one raised later is turned into a last frame by ``on_error``;
- always closes ``frames`` (aborting the engine request) when the client disconnects,
  the stream fails or the server cancels the request, so KV pages never leak;
- escapes the Unicode line separators JSON may leave raw (:func:`escape_line_breaks`).
"""

from __future__ import annotations

import asyncio
import itertools
from typing import Any, AsyncIterator, Callable, Iterable, Optional, Union

import msgspec
from litestar import Request
from litestar.datastructures import Cookie
from litestar.response import Stream
from litestar.response.base import ASGIResponse
from litestar.types import Receive, Scope, Send
from loguru import logger

from ninfer.errors import NinferError
from ninfer.server.admission import current_ticket
from ninfer.server.disconnect import wait_for_disconnect
from ninfer.server.errors import INTERNAL_MESSAGE, error_code, ninfer_error_body

Frame = Union[str, bytes]
ErrorRenderer = Callable[[NinferError], Frame]

#: characters a JSON encoder leaves raw that ``str.splitlines()`` takes for line breaks
#: (U+2028, U+2029, U+0085). SSE ends lines at CR and LF only, but readers built on
#: splitlines (httpx's ``iter_lines``, for one) cut such an event in two; written as
#: escapes the JSON is the same and every reader sees one line.
_SPLITLINES_BREAKS = ((b"\xe2\x80\xa8", b"\\u2028"), (b"\xe2\x80\xa9", b"\\u2029"), (b"\xc2\x85", b"\\u0085"))

KEEPALIVE_S = 5.0
KEEPALIVE_FRAME = b": keep-alive\n\n"
MEDIA_TYPE = "text/event-stream"
#: no caching, and no buffering by nginx-style proxies
SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}


def escape_line_breaks(body: bytes) -> bytes:
    """``body`` with :data:`_SPLITLINES_BREAKS` escaped (they only occur inside JSON strings;
    in UTF-8 none of these byte runs can be part of another character)."""
    if b"\xe2\x80" not in body and b"\xc2\x85" not in body:
        return body
    for raw, escaped in _SPLITLINES_BREAKS:
        body = body.replace(raw, escaped)
    return body


def openai_error_frame(exc: NinferError) -> Frame:
    """The default ``on_error``: an OpenAI-style error object as a data frame."""
    return b"data: " + msgspec.json.encode(ninfer_error_body(exc)) + b"\n\n"


def sse_response(
    frames: AsyncIterator[Frame],
    *,
    on_error: ErrorRenderer = openai_error_frame,
    keepalive_s: Optional[float] = None,
    headers: Optional[dict[str, str]] = None,
    keepalive_frame: Frame = KEEPALIVE_FRAME,
) -> SSEResponse:
    """A streaming response for ``frames`` (see the module docstring); ``keepalive_s``
    defaults to :data:`KEEPALIVE_S` as it is when called (tests shorten it)."""
    return SSEResponse(frames, on_error=on_error, keepalive_s=KEEPALIVE_S if keepalive_s is None else keepalive_s,
                       headers=headers, keepalive_frame=keepalive_frame)


class SSEResponse(Stream):
    def __init__(
        self,
        frames: AsyncIterator[Frame],
        *,
        on_error: ErrorRenderer = openai_error_frame,
        keepalive_s: float = KEEPALIVE_S,
        headers: Optional[dict[str, str]] = None,
        keepalive_frame: Frame = KEEPALIVE_FRAME,
    ):
        super().__init__(frames, media_type=MEDIA_TYPE, headers={**SSE_HEADERS, **(headers or {})})
        self.on_error = on_error
        self.keepalive_s = keepalive_s
        self.keepalive_frame = keepalive_frame

    def to_asgi_response(
        self,
        app: Any,
        request: Request,
        *,
        background: Any = None,
        cookies: Optional[Iterable[Cookie]] = None,
        encoded_headers: Optional[Iterable[tuple[bytes, bytes]]] = None,
        headers: Optional[dict[str, str]] = None,
        is_head_response: bool = False,
        media_type: Any = None,
        status_code: Optional[int] = None,
        type_encoders: Any = None,
    ) -> ASGIResponse:
        return _SSEStream(
            self.iterator,
            self.on_error,
            self.keepalive_s,
            self.keepalive_frame,
            headers={**(headers or {}), **self.headers},
            cookies=itertools.chain(self.cookies, cookies or ()),
            encoded_headers=encoded_headers,
            media_type=MEDIA_TYPE,
            status_code=self.status_code or status_code,
            background=self.background or background,
        )


class _SSEStream(ASGIResponse):
    _should_set_content_length = False

    def __init__(self, frames: AsyncIterator[Frame], on_error: ErrorRenderer, keepalive_s: float,
                 keepalive_frame: Frame, **kw: Any):
        super().__init__(**kw)
        self.frames = aiter(frames)
        self.on_error = on_error
        self.keepalive_s = keepalive_s
        self.keepalive_frame = keepalive_frame

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = False  # the status line went out
        opened = False  # a frame of the protocol's went out
        watcher = asyncio.ensure_future(wait_for_disconnect(receive))
        pending: Optional[asyncio.Future] = None  # the frames' next item, possibly still running
        try:
            while True:
                if pending is None:
                    pending = asyncio.ensure_future(anext(self.frames))
                done, _ = await asyncio.wait({pending, watcher}, timeout=self.keepalive_s,
                                             return_when=asyncio.FIRST_COMPLETED)
                if watcher in done:
                    return  # the client left; `finally` closes the frames
                last = False
                if pending in done:
                    finished, pending = pending, None
                    try:
                        frame = finished.result()
                    except StopAsyncIteration:
                        break
                    except Exception as exc:
                        if not started:
                            raise  # nothing sent yet: a plain HTTP error response
                        frame, last = self._error_frame(exc), True
                    opened = True
                else:
                    frame = self.keepalive_frame if opened else KEEPALIVE_FRAME
                if not started:
                    await self.start_response(send)
                    started = True
                body = escape_line_breaks(frame if isinstance(frame, bytes) else frame.encode())
                await send({"type": "http.response.body", "body": body, "more_body": True})
                if last:
                    break
            if not started:
                await self.start_response(send)
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            await self.after_response()  # background tasks, as Litestar's own responses run them
        finally:
            watcher.cancel()
            await self._close(pending)

    def _error_frame(self, exc: Exception) -> Frame:
        ticket = current_ticket()
        if ticket is not None:  # the status already went out as 200: the log line names the failure
            ticket.error_code = error_code(exc)
        if not isinstance(exc, NinferError):
            logger.opt(exception=exc).error("stream failed: unhandled {}", type(exc).__name__)
            exc = NinferError(INTERNAL_MESSAGE)
        return self.on_error(exc)

    async def _close(self, pending: Optional[asyncio.Future]) -> None:
        if pending is not None and not pending.done():
            # The frames are mid-step: cancelling that step unwinds them, running their
            # cleanup (the engine abort) in the step's own task.
            pending.cancel()
            await asyncio.wait({pending})
        elif pending is not None and not pending.cancelled():
            pending.exception()  # a step that finished as the client left: nobody needs it
        aclose = getattr(self.frames, "aclose", None)
        if aclose is not None:
            # Suspended at a yield: aclose() runs their `finally` blocks (a no-op once they
            # have finished). The shield keeps a second cancellation from cutting that short.
            await asyncio.shield(asyncio.ensure_future(aclose()))
