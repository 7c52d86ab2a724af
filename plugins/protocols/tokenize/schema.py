"""Wire shapes of /tokenize and /detokenize, as vLLM defines them.

/tokenize takes one of two bodies: a raw ``prompt`` (tokenized as given, special tokens
added when ``add_special_tokens``), or chat ``messages`` rendered through the chat
template exactly as Chat Completions renders them. Unknown top-level fields are ignored,
as on the other OpenAI-shaped routes.
"""

from __future__ import annotations

from typing import Any, Optional

import msgspec
from msgspec import Struct


class TokenizeCompletionRequest(Struct):
    prompt: str
    model: Optional[str] = None
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(Struct):
    messages: list[dict[str, Any]]
    model: Optional[str] = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False  # the template already writes the markers
    return_token_strs: bool = False
    tools: Optional[list[dict[str, Any]]] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None


class TokenizeResponse(Struct):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: Optional[list[str]] = None


class DetokenizeRequest(Struct):
    tokens: list[int]
    model: Optional[str] = None


class DetokenizeResponse(Struct):
    prompt: str


encoder = msgspec.json.Encoder()
