"""Choosing and building an engine's guided-decoding backend from the profile."""

from __future__ import annotations

from typing import Optional, Sequence

import attrs
from loguru import logger

from ninfer.engine.guided_state import GuidedState, Phase, ReasoningMarkers
from ninfer.guided.backend import GuideCompiler
from ninfer.guided.spec import GuideSpec
from ninfer.profile.schema import GUIDED_OFF

#: ``guided.backend`` when the profile names none (used if installed)
DEFAULT_BACKEND = "llguidance"


@attrs.frozen
class GuidedDecoding:
    """An engine's guide compiler plus the reasoning markers that delay a guide."""

    compiler: GuideCompiler
    markers: Optional[ReasoningMarkers] = None
    #: the tokenizer's end-of-sequence ids (the masks allow them once a guide may end)
    end_ids: tuple[int, ...] = ()

    def start(self, spec: GuideSpec, prompt_ids: Sequence[int], thinking: bool) -> GuidedState:
        """A request's guided state; raises InvalidRequestError for a bad guide."""
        matcher = self.compiler.matcher(spec)
        phase = self.markers.initial_phase(prompt_ids, thinking) if self.markers else Phase.ACTIVE
        return GuidedState(matcher, phase, self.markers, self.end_ids)


def build_guided_decoding(profile, registry, tokenizer, family, vocab_size: int) -> Optional[GuidedDecoding]:
    """The profile's ``guided.backend`` built for this tokenizer; None when off."""
    name = profile.guided.backend
    if name == GUIDED_OFF:
        return None
    if name is None:
        if DEFAULT_BACKEND not in registry.names("guided_decoding"):
            logger.warning("no {} guided-decoding plugin is installed: guided requests will be refused",
                           DEFAULT_BACKEND)
            return None
        name = DEFAULT_BACKEND
    backend = registry.get("guided_decoding", name, key="guided.backend")
    compiler = backend.factory(tokenizer, vocab_size)
    parser_name = profile.reasoning.parser or getattr(family, "reasoning_parser", None)
    parser = registry.get("reasoning_parser", parser_name, key="reasoning.parser") if parser_name else None
    markers = ReasoningMarkers.from_parser(parser, tokenizer) if parser is not None else None
    if parser is not None and markers is None:
        logger.warning("the reasoning close marker {!r} is not one token: guides apply from the first output token",
                       parser.end)
    return GuidedDecoding(compiler, markers, tuple(tokenizer.eos_token_ids))
