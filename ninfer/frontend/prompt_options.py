"""Thinking switch, reasoning effort and history reasoning, resolved against the chat template.

Protocols spell these options differently (Chat's ``reasoning_effort``, Responses'
``reasoning.effort``, Anthropic's ``thinking`` and ``output_config.effort``, the
``enable_thinking`` / ``preserve_thinking`` extensions); each adapter translates its
spellings into :class:`TemplateOptions`, and :func:`resolve_options` (run by the
pipeline, once for every protocol) checks them against what the loaded template can do
and fills in the server defaults.
"""

from __future__ import annotations

from typing import Any, Optional

import attrs

from ninfer.errors import InvalidRequestError, UnsupportedFeatureError
from ninfer.frontend.template_caps import TemplateCaps

#: every effort value a protocol may pass on; which ones work depends on the template
EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")


@attrs.frozen
class TemplateOptions:
    """A request's thinking switch, effort and history reasoning, before the template checks them."""

    effort: Optional[str] = None
    enable: Optional[bool] = None
    preserve: Optional[bool] = None
    #: the field that spelled ``effort`` (errors name it)
    effort_param: str = "reasoning_effort"
    #: True (OpenAI's rule): an effort other than "none" turns thinking on. False
    #: (Anthropic's): the effort applies only while thinking is on and switches nothing
    effort_enables: bool = True
    #: overrides of the server's defaults (a stored parent's preserve_thinking, a prefill
    #: that is continued without thinking)
    thinking_default: Optional[bool] = None
    preserve_default: Optional[bool] = None


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


def _check_effort(asked: TemplateOptions, caps: TemplateCaps) -> None:
    effort, param = asked.effort, asked.effort_param
    if effort not in EFFORTS:
        raise InvalidRequestError(f"{param} must be one of {', '.join(EFFORTS)}", param=param)
    if effort != "none" and effort not in caps.efforts:
        offered = (*(("none",) if asked.effort_enables else ()), *caps.efforts)  # "none" switches thinking off
        what = f"it offers: {', '.join(offered)}" if offered else "it offers no effort levels"
        raise InvalidRequestError(
            f"{param} {effort!r} is not offered by the loaded chat template ({what})",
            param=param, code="reasoning_effort_not_supported",
        )


def resolve_options(asked: TemplateOptions, caps: TemplateCaps, thinking_default: bool,
                    preserve_default: bool) -> PromptOptions:
    """Check the request's options against the template; unset ones take the defaults
    (the request's overrides first, then the server's ``thinking_default`` / ``preserve_default``).

    A template without a thinking switch renders the same prompt whatever the request
    says, so the default decides its thinking mode.
    """
    enable = asked.enable
    if asked.effort is not None:
        _check_effort(asked, caps)
        if asked.effort_enables:
            if enable is not None and enable != (asked.effort != "none"):
                raise InvalidRequestError(
                    f"{asked.effort_param} {asked.effort!r} contradicts enable_thinking={str(enable).lower()}",
                    param=asked.effort_param, code="conflicting_template_option")
            enable = asked.effort != "none"
    if asked.preserve and not caps.preserve_thinking:
        raise UnsupportedFeatureError("preserve_thinking: the loaded chat template cannot keep earlier turns' "
                                      "reasoning", param="preserve_thinking")
    default = thinking_default if asked.thinking_default is None else asked.thinking_default
    thinking = enable if enable is not None and caps.enable_thinking else default
    preserve = preserve_default if asked.preserve_default is None else asked.preserve_default
    effort = asked.effort if asked.effort != "none" and (asked.effort_enables or thinking) else None
    return PromptOptions(thinking, preserve if asked.preserve is None else asked.preserve, effort)


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
