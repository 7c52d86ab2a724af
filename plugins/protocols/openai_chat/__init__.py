"""OpenAI Chat Completions (POST /v1/chat/completions), with llama.cpp's timing extensions."""

from ninfer.capabilities import Protocol
from ninfer.hookspecs import hookimpl
from ninfer_plugins.protocols.openai_chat.routes import chat_routes


@hookimpl
def register_protocols(register):
    register(Protocol(name="openai_chat", description="OpenAI Chat Completions (/v1/chat/completions)",
                      routes=chat_routes))
