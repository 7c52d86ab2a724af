"""Field checks of a chat request that the schema's types cannot express.

Each rejection names the field (``param``). Capability fields are refused only when
they ask for behaviour ninfer cannot provide; their neutral values pass, so payloads
that generic clients fill in with defaults keep working. The sampling fields are checked
through :data:`.schema.SAMPLING`.
"""

from __future__ import annotations

from typing import Any

from ninfer.errors import InvalidRequestError, UnsupportedFeatureError
from ninfer.frontend.tool_grammar import check_name
from ninfer_plugins.protocols.openai_chat.schema import SAMPLING, ChatCompletionRequest
from ninfer.frontend.openai_cache_hints import check_breakpoint, check_cache_hints


def validate_request(req: ChatCompletionRequest) -> None:
    """Raise :class:`InvalidRequestError` / :class:`UnsupportedFeatureError` for the first bad field."""
    SAMPLING.check(req)  # token ids against the vocabulary: in .translate.sampling_params
    if req.top_logprobs and not req.logprobs:
        raise InvalidRequestError("top_logprobs needs logprobs: true", param="top_logprobs")
    _check_output_format(req)
    _check_tools(req)
    _check_capabilities(req)
    _check_cache_hints(req)


def _unsupported(param: str, what: str) -> UnsupportedFeatureError:
    return UnsupportedFeatureError(f"{param}: {what}", param=param)


def _check_output_format(req: ChatCompletionRequest) -> None:
    # response_format and the constrained-decoding fields are checked by .guided
    if req.modalities is not None and any(m != "text" for m in req.modalities):
        raise _unsupported("modalities", "only text output is supported")
    if req.verbosity not in (None, "medium"):
        raise _unsupported("verbosity", "only the default verbosity (medium) is supported")
    if req.store:
        raise _unsupported("store", "stored chat completions are not supported")


def _check_tools(req: ChatCompletionRequest) -> None:
    if req.functions:
        raise _unsupported("functions", "legacy function definitions are not supported; use tools")
    if isinstance(req.function_call, dict) or req.function_call not in (None, "none", "auto"):
        raise _unsupported("function_call", "legacy forced function calls are not supported")
    for i, tool in enumerate(req.tools or []):
        if tool.type != "function":
            raise _unsupported(f"tools[{i}].type", f"{tool.type!r} tools are not supported, only function tools")
        if tool.function is None:
            raise InvalidRequestError("a function tool needs a function definition", param=f"tools[{i}].function")
        if not tool.function.name:
            raise InvalidRequestError("a function needs a name", param=f"tools[{i}].function.name")
        check_name(tool.function.name, f"tools[{i}].function.name")  # else never called, whatever tool_choice
    allowed_tool_names(req)  # validates tool_choice


def _declared(req: ChatCompletionRequest) -> set[str]:
    return {t.function.name for t in req.tools or [] if t.function is not None}


def _named_function(choice: dict[str, Any], req: ChatCompletionRequest) -> str:
    fn = choice.get("function")
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise InvalidRequestError("a named tool choice needs function.name", param="tool_choice.function.name")
    if name not in _declared(req):
        raise InvalidRequestError(f"no tool named {name!r} is declared", param="tool_choice.function.name")
    return name


def named_tool(req: ChatCompletionRequest) -> str | None:
    """The function a ``{"type": "function"}`` tool_choice forces (checked by :func:`allowed_tool_names`)."""
    choice = req.tool_choice
    return _named_function(choice, req) if isinstance(choice, dict) and choice.get("type") == "function" else None


def allowed_tool_names(req: ChatCompletionRequest) -> list[str] | None:
    """Function names ``tool_choice`` leaves callable; None when every tool is.

    A named function keeps every tool in the prompt (and the parser); only the call
    grammar narrows to it.
    """
    choice = req.tool_choice
    if choice is None or choice in ("auto", "none", "required"):
        return [] if choice == "none" else None
    if isinstance(choice, str):
        raise InvalidRequestError("tool_choice must be none, auto, required, or an object", param="tool_choice")
    kind = choice.get("type")
    if kind == "function":
        _named_function(choice, req)
        return None
    if kind == "custom":
        raise _unsupported("tool_choice", "custom tools are not supported, only functions")
    if kind != "allowed_tools":
        raise InvalidRequestError(f"tool_choice type {kind!r} is not recognised", param="tool_choice.type")
    spec = choice.get("allowed_tools")
    if not isinstance(spec, dict):
        raise InvalidRequestError("allowed_tools must be an object", param="tool_choice.allowed_tools")
    if spec.get("mode", "auto") not in ("auto", "required"):
        raise InvalidRequestError("tool_choice.allowed_tools.mode must be auto or required",
                                  param="tool_choice.allowed_tools.mode")
    declared = _declared(req)
    names = []
    for j, entry in enumerate(spec.get("tools") or []):
        fn = entry.get("function") if isinstance(entry, dict) else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(entry, dict) or entry.get("type") != "function" or not isinstance(name, str):
            raise InvalidRequestError(
                "allowed tools must be function references", param=f"tool_choice.allowed_tools.tools[{j}]"
            )
        if name not in declared:
            raise InvalidRequestError(f"no tool named {name!r} is declared", param=f"tool_choice.allowed_tools.tools[{j}]")
        names.append(name)
    return names


def forces_tool_call(req: ChatCompletionRequest) -> bool:
    """``tool_choice`` requires a call: required, a named function, or allowed_tools in required mode."""
    choice = req.tool_choice
    if not isinstance(choice, dict):
        return choice == "required"
    spec = choice.get("allowed_tools")
    return choice.get("type") == "function" or (isinstance(spec, dict) and spec.get("mode") == "required")


def callable_tools(req: ChatCompletionRequest) -> list[dict[str, Any]]:
    """Tool definitions the model may call, in declaration order (template shape)."""
    allowed = allowed_tool_names(req)
    out = []
    for tool in req.tools or []:
        fn = tool.function
        if fn is None or (allowed is not None and fn.name not in allowed):
            continue
        definition: dict[str, Any] = {"name": fn.name}
        if fn.description is not None:
            definition["description"] = fn.description
        if fn.parameters is not None:
            definition["parameters"] = fn.parameters
        out.append({"type": "function", "function": definition})
    return out


def _check_capabilities(req: ChatCompletionRequest) -> None:
    if req.web_search_options is not None:
        raise _unsupported("web_search_options", "web search is not supported")
    if req.moderation not in (None, False):
        raise _unsupported("moderation", "moderation is not supported")
    if any(v is not None for v in (req.mm_processor_kwargs or {}).values()):
        raise _unsupported("mm_processor_kwargs", "media processor options are not supported")


def _check_cache_hints(req: ChatCompletionRequest) -> None:
    check_cache_hints(req.prompt_cache_retention, req.prompt_cache_options)
    for i, message in enumerate(req.messages):
        content = getattr(message, "content", None)
        for j, part in enumerate(content if isinstance(content, list) else ()):
            mark = getattr(part, "prompt_cache_breakpoint", None)
            if mark is not None:
                check_breakpoint(mark, f"messages[{i}].content[{j}]")
