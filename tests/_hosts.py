"""A pipeline owner without an engine, for request-side tests: planning and rendering only."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import attrs

from ninfer.frontend.pipeline import Pipeline
from ninfer.plugins import load_registry
from ninfer.profile.schema import Profile


@dataclass
class TokenizerHost:
    """What :class:`ninfer.frontend.host.ModelHost` asks for, around a bare tokenizer."""

    tokenizer: Any
    profile: Profile = field(default_factory=Profile)
    registry: Any = field(default_factory=load_registry)
    family: Any = None
    max_model_len: int = 4096
    kv_capacity_tokens: Optional[int] = None


def tokenizer_pipeline(tokenizer: Any, reasoning: Optional[str] = "qwen3", tools: Optional[str] = None,
                       max_model_len: int = 4096, profile: Optional[Profile] = None) -> Pipeline:
    """A :class:`Pipeline` over ``tokenizer`` with the named reasoning and tool parser plugins."""
    profile = profile or Profile()
    profile = attrs.evolve(profile, reasoning=attrs.evolve(profile.reasoning, parser=reasoning),
                           tools=attrs.evolve(profile.tools, parser=tools))
    return Pipeline(TokenizerHost(tokenizer, profile, max_model_len=max_model_len))
