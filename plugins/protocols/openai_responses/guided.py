"""``text.format`` -> the guide of a Response's answer (the pipeline combines it with the tools').

Formats: ``text`` (free), ``json_object`` and ``json_schema`` (``name``, ``schema``,
optional ``description`` and ``strict``; the schema is enforced either way). Tool
constraints come from :mod:`.tools` (``ToolSet.request``) and are combined by
:func:`ninfer.frontend.tool_guide.request_guide` inside the request pipeline.
"""

from __future__ import annotations

from typing import Any, Optional

from ninfer.errors import InvalidRequestError
from ninfer.guided.spec import GuideSpec
from ninfer_plugins.protocols.openai_responses.schema import TextOptions


def text_format_guide(text: Optional[TextOptions]) -> Optional[GuideSpec]:
    """Check ``text.format``; None for free text."""
    fmt: Optional[dict[str, Any]] = text.format if text is not None else None
    kind = (fmt or {}).get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return GuideSpec("json_object", None, "text.format")
    if kind != "json_schema":
        raise InvalidRequestError("text.format.type must be text, json_object or json_schema",
                                  param="text.format.type")
    assert fmt is not None
    if not isinstance(fmt.get("name", ""), str):
        raise InvalidRequestError("text.format.name must be a string", param="text.format.name")
    if not isinstance(fmt.get("schema"), dict):
        raise InvalidRequestError("text.format.schema must be a JSON schema object", param="text.format.schema")
    return GuideSpec("json_schema", fmt["schema"], "text.format.schema")
