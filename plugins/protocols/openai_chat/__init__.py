"""OpenAI Chat Completions (POST /v1/chat/completions), with llama.cpp's timing extensions."""

from ninfer.capabilities import Protocol
from ninfer.hookspecs import hookimpl


@hookimpl
def register_protocols(register):
    register(Protocol(name="openai_chat", description="OpenAI Chat Completions (/v1/chat/completions)",
                      routes=_routes))


def _routes(state):
    # Imported on use: listing plugins, checking profiles and the batch runner never
    # need the web stack.
    from ninfer_plugins.protocols.openai_chat.routes import chat_routes

    return chat_routes(state)
