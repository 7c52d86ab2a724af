"""Top-level fields of a Messages request: model, sampling, thinking, output options.

Fields whose behaviour needs something ninfer lacks (containers, MCP servers) are
refused naming the field; advisory ones (metadata, service tier, context management,
beta flags...) are ignored by the schema. Structured output is read by :mod:`.guided`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional

from ninfer.errors import InvalidRequestError, UnsupportedFeatureError
from ninfer.sampling_params import SamplingParams
from ninfer_plugins.protocols.anthropic_messages.schema import SAMPLING, MessagesRequest

#: the smallest budget Anthropic accepts for enabled thinking
MIN_THINKING_BUDGET = 1024
THINKING_TYPES = ("enabled", "adaptive", "disabled")
EFFORTS = ("low", "medium", "high", "xhigh", "max")


@dataclass(frozen=True)
class ThinkingConfig:
    """The request's ``thinking``: ``mode`` None when omitted; ``budget`` only for enabled."""

    mode: Optional[str] = None
    budget: Optional[int] = None


def check_model(model: Optional[str]) -> None:
    """Any non-empty label: it is echoed back, never used to pick weights."""
    if not model:
        raise InvalidRequestError("model must be a non-empty string", param="model")


def check_unsupported(req: MessagesRequest) -> None:
    if req.container is not None:
        raise UnsupportedFeatureError("containers are not supported (ninfer runs no code)", param="container")
    if req.mcp_servers:
        raise UnsupportedFeatureError("MCP servers are not supported (ninfer calls no tools itself)",
                                      param="mcp_servers")


def requested_effort(output_config: Any) -> Optional[str]:
    """``output_config.effort`` as Anthropic spells it (the pipeline checks that the template offers it)."""
    if output_config is None:
        return None
    if not isinstance(output_config, Mapping):
        raise InvalidRequestError("output_config must be an object", param="output_config")
    effort = output_config.get("effort")
    if effort is None:
        return None
    if effort not in EFFORTS:
        raise InvalidRequestError(f"effort must be one of {', '.join(EFFORTS)}", param="output_config.effort")
    return effort


def parse_thinking(thinking: Any, max_tokens: Optional[int]) -> ThinkingConfig:
    """Validate ``thinking``; an enabled budget must lie in [1024, max_tokens) when max_tokens is known."""
    if thinking is None:
        return ThinkingConfig()
    if not isinstance(thinking, Mapping):
        raise InvalidRequestError("thinking must be an object", param="thinking")
    mode = thinking.get("type")
    if mode not in THINKING_TYPES:
        raise InvalidRequestError(f"thinking.type must be one of {', '.join(THINKING_TYPES)}", param="thinking.type")
    display = thinking.get("display")
    if display == "omitted":
        raise UnsupportedFeatureError("omitted thinking is not supported: ninfer cannot hand back encrypted "
                                      "reasoning to restore later; use summarized", param="thinking.display")
    if display not in (None, "summarized"):
        raise InvalidRequestError("thinking.display must be summarized or omitted", param="thinking.display")
    if mode != "enabled":
        return ThinkingConfig(mode)
    budget = thinking.get("budget_tokens")
    if isinstance(budget, bool) or not isinstance(budget, int):
        raise InvalidRequestError("enabled thinking needs an integer budget_tokens", param="thinking.budget_tokens")
    if budget < MIN_THINKING_BUDGET:
        raise InvalidRequestError(f"budget_tokens must be at least {MIN_THINKING_BUDGET}",
                                  param="thinking.budget_tokens")
    if max_tokens is not None and budget >= max_tokens:
        raise InvalidRequestError(f"budget_tokens ({budget}) must be less than max_tokens ({max_tokens})",
                                  param="thinking.budget_tokens")
    return ThinkingConfig(mode, budget)


def sampling_params(req: MessagesRequest, vocab_size: int) -> SamplingParams:
    """The engine's parameters; ``max_tokens`` None leaves the server default to the engine."""
    return SamplingParams(**SAMPLING.params(req, vocab_size=vocab_size))
