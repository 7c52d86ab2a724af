"""Refusing a prompt or an output limit that cannot fit, the same way at every front door.

These run while a request is prepared, so a refusal is a preparation error (logged as
``request_rejected``, never as a started request) and names the field the client sent:
``GenerateRequest.prompt_param`` and ``max_tokens_param`` carry the wire names.
"""

from __future__ import annotations

from typing import Optional

from ninfer.errors import ContextLengthExceededError


def check_prompt_length(prompt_tokens: int, max_context: int, param: str = "messages") -> None:
    """A rendered prompt longer than the context is the prompt's fault, whatever max_tokens says."""
    if prompt_tokens > max_context:
        raise ContextLengthExceededError(
            f"the prompt has {prompt_tokens} tokens; the context holds {max_context}", param=param
        )


def fit_output_limit(prompt_tokens: int, requested: Optional[int], max_context: int, kv_tokens: Optional[int],
                     *, fit: bool = False, prompt_param: str = "messages",
                     max_tokens_param: str = "max_tokens") -> Optional[int]:
    """The output limit a prompt runs with: ``requested``, or shortened to the room when ``fit``.

    ``requested`` None leaves the server's default to the engine, which shortens it to the
    room; there must still be room for one token. ``fit`` makes ``requested`` a ceiling
    (the batch format's max_generate_length), otherwise it is a demand the prompt must
    leave room for. ``kv_tokens`` is the KV pool's size (None: as large as the context): one
    request alone must fit it, or waiting would never admit it.
    """
    check_prompt_length(prompt_tokens, max_context, param=prompt_param)
    if kv_tokens is not None and prompt_tokens > kv_tokens:
        raise ContextLengthExceededError(
            f"the prompt has {prompt_tokens} tokens; the KV capacity holds {kv_tokens}", param=prompt_param
        )
    room = min(max_context, kv_tokens if kv_tokens is not None else max_context) - prompt_tokens
    if requested == 0:  # prompt processing only: needs no room
        return 0
    if requested is None or fit:
        if room < 1:
            raise ContextLengthExceededError(
                f"the prompt has {prompt_tokens} tokens and leaves no room for output "
                f"(context {max_context} tokens{_kv(kv_tokens, max_context)})", param=prompt_param
            )
        return None if requested is None else min(requested, room)
    if prompt_tokens + requested > max_context:
        raise ContextLengthExceededError(
            f"prompt ({prompt_tokens} tokens) plus {max_tokens_param} ({requested}) exceeds the context "
            f"of {max_context} tokens", param=max_tokens_param
        )
    if kv_tokens is not None and prompt_tokens + requested > kv_tokens:
        raise ContextLengthExceededError(
            f"prompt ({prompt_tokens} tokens) plus {max_tokens_param} ({requested}) exceeds the KV capacity "
            f"of {kv_tokens} tokens", param=max_tokens_param
        )
    return requested


def _kv(kv_tokens: Optional[int], max_context: int) -> str:
    return f", KV capacity {kv_tokens} tokens" if kv_tokens is not None and kv_tokens < max_context else ""
