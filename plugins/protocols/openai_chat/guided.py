"""A chat request's output constraints -> the answer guide and the :class:`ToolRequest`.

Constraints come from ``response_format`` (json_object, json_schema), from the
constrained-decoding fields other servers accept (vLLM's ``guided_*`` and
``structured_outputs``, llama.cpp's ``grammar``), and from the tools: a required or
named ``tool_choice``, ``parallel_tool_calls: false`` and strict functions. At most one
answer constraint may be given; the pipeline combines it with the tool constraints into
the one guide the engine follows (:mod:`ninfer.frontend.tool_guide`). Errors name the
field at fault.
"""

from __future__ import annotations

import json
from typing import Any, Optional

from ninfer.errors import InvalidRequestError
from ninfer.frontend.tool_schema import ToolSpec
from ninfer.guided.spec import GuideSpec
from ninfer_plugins.protocols.openai_chat.schema import ChatCompletionRequest
from ninfer_plugins.protocols.openai_chat.validate import allowed_tool_names, forces_tool_call, named_tool
from ninfer.frontend.tool_guide import ToolRequest

#: ``structured_outputs`` members that constrain (others are backend hints, ignored)
STRUCTURED_KINDS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "ebnf",
                    "json_object": "json_object", "structural_tag": "structural_tag"}
#: top-level extension fields -> guide kind
EXTENSION_KINDS = {"guided_json": "json_schema", "guided_regex": "regex", "guided_choice": "choice",
                   "guided_grammar": "ebnf", "grammar": "ebnf"}


def _json_value(value: Any, param: str, what: str) -> dict[str, Any]:
    """An object given inline or as JSON text."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise InvalidRequestError(f"{param} must be {what} (an object or its JSON text)", param=param) from None
    if not isinstance(value, dict):
        raise InvalidRequestError(f"{param} must be {what} (an object or its JSON text)", param=param)
    return value


def guide_of(kind: str, value: Any, param: str) -> GuideSpec:
    """One constraint of ``kind`` from a wire value, checked for shape."""
    if kind == "json_object":
        if value is not True:
            raise InvalidRequestError(f"{param} must be true", param=param)
        return GuideSpec("json_object", None, param)
    if kind in ("json_schema", "structural_tag"):
        what = "a JSON schema" if kind == "json_schema" else "a structural tag"
        return GuideSpec(kind, _json_value(value, param, what), param)
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(v, str) for v in value):
            raise InvalidRequestError(f"{param} must be a non-empty array of strings", param=param)
        return GuideSpec("choice", list(value), param)
    if not isinstance(value, str) or not value:
        raise InvalidRequestError(f"{param} must be a non-empty string", param=param)
    return GuideSpec(kind, value, param)  # regex, ebnf


def response_format_guide(fmt: Optional[dict[str, Any]]) -> Optional[GuideSpec]:
    kind = (fmt or {}).get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return GuideSpec("json_object", None, "response_format")
    if kind != "json_schema":
        raise InvalidRequestError("response_format.type must be text, json_object or json_schema",
                                  param="response_format.type")
    spec = fmt.get("json_schema") if fmt else None
    if not isinstance(spec, dict):
        raise InvalidRequestError("response_format.json_schema must be an object with a schema",
                                  param="response_format.json_schema")
    if not isinstance(spec.get("name", ""), str):
        raise InvalidRequestError("response_format.json_schema.name must be a string",
                                  param="response_format.json_schema.name")
    if not isinstance(spec.get("schema"), dict):
        raise InvalidRequestError("response_format.json_schema.schema must be a JSON schema object",
                                  param="response_format.json_schema.schema")
    return GuideSpec("json_schema", spec["schema"], "response_format.json_schema.schema")


def _structured_outputs(value: Any) -> list[GuideSpec]:
    if not isinstance(value, dict):
        raise InvalidRequestError("structured_outputs must be an object", param="structured_outputs")
    return [guide_of(kind, value[key], f"structured_outputs.{key}") for key, kind in STRUCTURED_KINDS.items()
            if value.get(key) not in (None, False)]


def answer_guide(req: ChatCompletionRequest) -> Optional[GuideSpec]:
    """The constraint on the answer text, if any; two at once are refused."""
    found = [g for g in (response_format_guide(req.response_format),) if g is not None]
    found += [guide_of(kind, getattr(req, name), name) for name, kind in EXTENSION_KINDS.items()
              if getattr(req, name) is not None]
    if req.structured_outputs is not None:
        found += _structured_outputs(req.structured_outputs)
    if len(found) > 1:
        raise InvalidRequestError(f"{found[1].param} and {found[0].param} both constrain the output; give one",
                                  param=found[1].param, code="conflicting_output_constraints")
    return found[0] if found else None


def tool_request(req: ChatCompletionRequest) -> ToolRequest:
    """The functions calls may name (after tool_choice) with their strictness, and how calls are limited."""
    named = named_tool(req)
    allowed = [named] if named is not None else allowed_tool_names(req)
    specs = [
        ToolSpec(tool.function.name, tool.function.parameters or {}, strict=bool(tool.function.strict),
                 param=f"tools[{i}].function.parameters")
        for i, tool in enumerate(req.tools or [])
        if tool.function is not None and (allowed is None or tool.function.name in allowed)
    ]
    return ToolRequest(specs, forced=forces_tool_call(req), parallel=req.parallel_tool_calls is not False)
