"""``encrypted_content`` of reasoning Items: an opaque envelope that carries the reasoning.

Clients that keep no server state (``store: false``, Codex) ask for
``include: ["reasoning.encrypted_content"]`` and replay reasoning Items holding only
this field. The envelope is URL-safe base64 of a small versioned JSON object holding
the raw reasoning text, so a replay restores the text exactly, across server
restarts and processes. It is not encrypted and not signed: the reasoning was
already sent to the client in the clear, and a client could replay any text as
``reasoning_text`` anyway, so secrecy or a signature would protect nothing.
"""

from __future__ import annotations

import base64
import binascii
import json
from typing import Optional

#: the marker member and the format version this server writes and reads
MARKER = "ninfer_reasoning"
VERSION = 1


def seal(text: str) -> str:
    envelope = json.dumps({MARKER: VERSION, "text": text}, ensure_ascii=False, separators=(",", ":"))
    return base64.urlsafe_b64encode(envelope.encode("utf-8")).decode("ascii")


def unseal(token: str) -> Optional[str]:
    """The reasoning text of an envelope this server wrote; None for anything else."""
    try:
        envelope = json.loads(base64.urlsafe_b64decode(token.encode("ascii")))
    except (ValueError, UnicodeError, binascii.Error):
        return None
    if not isinstance(envelope, dict) or envelope.get(MARKER) != VERSION:
        return None
    text = envelope.get("text")
    return text if isinstance(text, str) else None
