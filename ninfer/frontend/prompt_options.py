"""Thinking switch, reasoning effort and history reasoning, resolved against the chat template.

Protocols spell these options differently (Chat's ``reasoning_effort``, Responses'
``reasoning.effort``, ``enable_thinking`` / ``preserve_thinking`` extensions); each
adapter extracts its values and hands them to :func:`resolve_prompt_options`, which
checks them against what the loaded template can do and fills in the server defaults.
"""

from __future__ import annotations

from typing import Any, Optional

import attrs

from ninfer.errors import InvalidRequestError, UnsupportedFeatureError
from ninfer.frontend.template_caps import TemplateCaps

#: every effort value of the OpenAI protocols; which ones work depends on the template
EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")


@attrs.frozen
class PromptOptions:
    """Resolved template options: ``effort`` is None when the template default applies."""

    thinking: bool
    preserve_thinking: bool
    effort: Optional[str]


def pick_spelling(values: dict[str, Any], key: str) -> Optional[bool]:
    """One boolean option given under several spellings (``{param: value}``); all must agree."""
    given = {param: v for param, v in values.items() if v is not None}
    for param, value in given.items():
        if not isinstance(value, bool):
            raise InvalidRequestError(f"{key} must be a boolean", param=param)
    if len(set(given.values())) > 1:
        raise InvalidRequestError(f"the spellings of {key} disagree ({', '.join(given)})",
                                  param=next(iter(given)), code="conflicting_template_option")
    return next(iter(given.values()), None)


def resolve_prompt_options(
    caps: TemplateCaps,
    *,
    effort: Optional[str],
    enable: Optional[bool],
    preserve: Optional[bool],
    thinking_default: bool,
    preserve_default: bool,
    effort_param: str = "reasoning_effort",
) -> PromptOptions:
    """Check the request's options against the template; unset ones take the server defaults.

    ``effort`` "none" turns thinking off; other efforts must be offered by the template.
    A template without a thinking switch renders the same prompt whatever the request
    says, so the server default decides its thinking mode.
    """
    if effort is not None:
        if effort not in EFFORTS:
            raise InvalidRequestError(f"{effort_param} must be one of {', '.join(EFFORTS)}", param=effort_param)
        if effort != "none" and effort not in caps.efforts:
            offered = ", ".join(("none", *caps.efforts))
            raise InvalidRequestError(
                f"{effort_param} {effort!r} is not offered by the loaded chat template (it offers: {offered})",
                param=effort_param, code="reasoning_effort_not_supported",
            )
        if enable is not None and enable != (effort != "none"):
            raise InvalidRequestError(f"{effort_param} {effort!r} contradicts enable_thinking={str(enable).lower()}",
                                      param=effort_param, code="conflicting_template_option")
        enable = effort != "none"
    if preserve and not caps.preserve_thinking:
        raise UnsupportedFeatureError("preserve_thinking: the loaded chat template cannot keep earlier turns' "
                                      "reasoning", param="preserve_thinking")
    return PromptOptions(
        thinking=enable if enable is not None and caps.enable_thinking else thinking_default,
        preserve_thinking=preserve_default if preserve is None else preserve,
        effort=effort if effort not in (None, "none") else None,
    )


def template_kwargs(options: PromptOptions, caps: TemplateCaps) -> dict[str, Any]:
    """Only variables the template reads: others would be silently meaningless."""
    kwargs: dict[str, Any] = {}
    if caps.enable_thinking:
        kwargs["enable_thinking"] = options.thinking
    if caps.preserve_thinking:
        kwargs["preserve_thinking"] = options.preserve_thinking
    if options.effort is not None:
        kwargs["reasoning_effort"] = options.effort
    return kwargs
