"""OpenAI Responses (POST /v1/responses and its local store), see docs/responses.md."""

from ninfer.capabilities import Protocol
from ninfer.hookspecs import hookimpl


@hookimpl
def register_protocols(register):
    register(Protocol(name="openai_responses", description="OpenAI Responses (/v1/responses)",
                      routes=_routes))


def _routes(state):
    # Imported on use: listing plugins, checking profiles and the batch runner never
    # need the web stack.
    from ninfer_plugins.protocols.openai_responses.routes import responses_routes

    return responses_routes(state)
