"""Anthropic's server-sent events for one message.

Order: ``message_start`` (sent once the engine has admitted the request, so its
uncached / cache-read split is final), a ``ping``, then per content block
``content_block_start``, its deltas and ``content_block_stop``; at the end
``message_delta`` with the stop reason and cumulative usage, and ``message_stop``.
Every frame names its event, which Anthropic's SDKs dispatch on.
"""

from __future__ import annotations

from typing import Any, AsyncIterator

from ninfer.frontend.choice_output import ChoiceEvent
from ninfer_plugins.protocols.anthropic_messages.output import BlockDelta, BlockEvent, BlockStart, MessageState
from ninfer_plugins.protocols.anthropic_messages.schema import Message, encoder


def frame(event: str, payload: Any) -> bytes:
    return b"event: " + event.encode() + b"\ndata: " + encoder.encode(payload) + b"\n\n"


#: sent after message_start and whenever the stream is idle after it; before message_start
#: (queued, preparing) the idle frame is the transport's ``: keep-alive`` comment, since no
#: Anthropic event may come first
PING = frame("ping", {"type": "ping"})


def block_frame(event: BlockEvent) -> bytes:
    if isinstance(event, BlockStart):
        return frame("content_block_start", {"type": "content_block_start", "index": event.index,
                                             "content_block": event.block})
    if isinstance(event, BlockDelta):
        return frame("content_block_delta", {"type": "content_block_delta", "index": event.index,
                                             "delta": event.delta})
    return frame("content_block_stop", {"type": "content_block_stop", "index": event.index})


def message_start(state: MessageState, message_id: str, model: str) -> bytes:
    message = Message(id=message_id, model=model, content=[], stop_reason=None, stop_sequence=None,
                      usage=state.usage())
    return frame("message_start", {"type": "message_start", "message": message})


def message_end(state: MessageState) -> list[bytes]:
    reason, sequence = state.stop()
    delta = {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
             "usage": state.usage()}
    return [frame("message_delta", delta), frame("message_stop", {"type": "message_stop"})]


async def frames(state: MessageState, events: AsyncIterator[ChoiceEvent], message_id: str,
                 model: str) -> AsyncIterator[bytes]:
    """Every frame of the stream. Nothing is sent before the engine's first (admission)
    event, so a request refused at admission still gets a plain HTTP error."""
    started = False
    async for event in events:
        blocks = state.feed(event)
        if not started:
            started = True
            yield message_start(state, message_id, model)
            yield PING
        for block in blocks:
            yield block_frame(block)
        if event.finished:
            for payload in message_end(state):
                yield payload
