"""A request's tool choice, strict tools and answer format -> the one guide its output follows.

Every protocol spells these differently; each extracts them into :class:`ToolRequest`
and calls :func:`request_guide`. Tool calls are written in the active tool parser's
format, so that parser's ``grammar`` builds any guide that involves tools. A request
that constrains nothing gets no guide at all: plain tool use stays as fast as before.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Sequence

import attrs

from ninfer.capabilities import ToolParser
from ninfer.errors import InvalidRequestError, UnsupportedFeatureError
from ninfer.frontend.tool_schema import ToolSpec
from ninfer.guided.spec import GuideSpec

if TYPE_CHECKING:
    from ninfer.frontend.host import ModelHost


@attrs.frozen
class ToolRequest:
    """What a request asks of its tool calls."""

    #: the callable tools (already narrowed by a named or allowed-tools choice)
    tools: Sequence[ToolSpec] = ()
    #: the answer must be tool calls (required, any, or a named tool)
    forced: bool = False
    #: more than one call may be made
    parallel: bool = True
    #: the request field that forced calls or chose tools, for errors
    choice_param: str = "tool_choice"
    #: the request field that limited calls to one, for errors
    parallel_param: str = "parallel_tool_calls"


def tool_parser(host: ModelHost) -> Optional[ToolParser]:
    """The tool parser that reads this server's output (the profile's choice, else the family's)."""
    name = host.profile.tools.parser or getattr(host.family, "tool_parser", None)
    return host.registry.get("tool_parser", name, key="tools.parser") if name else None


def _needs_grammar(req: ToolRequest, answer: Optional[GuideSpec]) -> Optional[str]:
    """The field that makes a tool grammar necessary (None: calls stay free)."""
    if req.forced:
        return req.choice_param
    if not req.parallel:
        return req.parallel_param
    strict = next((t for t in req.tools if t.strict), None)
    if strict is not None:
        return strict.param
    return answer.param if answer is not None else None


def request_guide(req: ToolRequest, answer: Optional[GuideSpec], parser: Optional[ToolParser]) -> Optional[GuideSpec]:
    """The guide for a request's output: ``answer`` constrains a plain (non-call) answer."""
    if not req.tools:
        if req.forced:
            raise InvalidRequestError(f"{req.choice_param}: a tool call is required but no tool is callable",
                                      param=req.choice_param)
        return answer
    cause = _needs_grammar(req, answer)
    if cause is None:
        return None
    if parser is None or parser.grammar is None:
        what = f"the {parser.name} tool-call format" if parser is not None else "this model (it has no tool parser)"
        raise UnsupportedFeatureError(f"{cause}: {what} cannot be constrained by a grammar", param=cause)
    return parser.grammar(list(req.tools), "required" if req.forced else "auto", parallel=req.parallel,
                          answer=None if req.forced else answer)
