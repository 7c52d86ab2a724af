"""Structured output (``output_config.format``, or the older top-level ``output_format``).

Both carry ``{"type": "json_schema", "schema": {...}}``; the text answer must then be
JSON following the schema. Given both, they must agree. Tool constraints come from
:mod:`.tools` and combine with it in :func:`ninfer.frontend.tool_guide.request_guide`.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

from ninfer.errors import InvalidRequestError
from ninfer.guided.spec import GuideSpec
from ninfer_plugins.protocols.anthropic_messages.schema import MessagesRequest


def format_guide(value: Any, param: str) -> Optional[GuideSpec]:
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise InvalidRequestError(f"{param} must be an object", param=param)
    if value.get("type") != "json_schema":
        raise InvalidRequestError(f"{param}.type must be json_schema", param=f"{param}.type")
    schema = value.get("schema")
    if not isinstance(schema, Mapping):
        raise InvalidRequestError(f"{param}.schema must be a JSON schema object", param=f"{param}.schema")
    return GuideSpec("json_schema", dict(schema), f"{param}.schema")


def answer_guide(req: MessagesRequest) -> Optional[GuideSpec]:
    """The constraint on the text answer, if the request asks for structured output."""
    config = req.output_config if isinstance(req.output_config, Mapping) else {}
    current = format_guide(config.get("format"), "output_config.format")
    legacy = format_guide(req.output_format, "output_format")
    if current is not None and legacy is not None and current.value != legacy.value:
        raise InvalidRequestError("output_format and output_config.format disagree; give one",
                                  param="output_format", code="conflicting_output_constraints")
    return current or legacy
