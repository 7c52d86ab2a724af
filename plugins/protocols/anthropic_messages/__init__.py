"""Anthropic Messages (POST /v1/messages and /v1/messages/count_tokens)."""

from ninfer.capabilities import Protocol
from ninfer.hookspecs import hookimpl


@hookimpl
def register_protocols(register):
    register(Protocol(name="anthropic_messages", description="Anthropic Messages (/v1/messages)",
                      routes=_routes))


def _routes(state):
    # Imported on use: listing plugins, checking profiles and the batch runner never
    # need the web stack.
    from ninfer_plugins.protocols.anthropic_messages.routes import messages_routes

    return messages_routes(state)
