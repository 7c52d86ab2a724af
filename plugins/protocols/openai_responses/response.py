"""The Response object: request echo, status, output Items and usage."""

from __future__ import annotations

import time
import uuid
from typing import Any, Optional

import attrs

from ninfer.errors import NinferError
from ninfer.frontend.choice_output import ChoiceEvent, ChoiceProgress
from ninfer_plugins.protocols.openai_responses.output import Event, OutputAssembler
from ninfer_plugins.protocols.openai_responses.schema import CreateRequest
from ninfer_plugins.protocols.openai_responses.tools import ToolIdentity
from ninfer_plugins.protocols.openai_responses.validate import ENCRYPTED_REASONING


def new_response_id() -> str:
    return f"resp_{uuid.uuid4().hex}"


@attrs.frozen
class Echo:
    """The request settings every Response object repeats."""

    fields: dict[str, Any]

    @classmethod
    def of(cls, req: CreateRequest, model: str) -> "Echo":
        reasoning = req.reasoning
        options = req.text
        text: dict[str, Any] = {"format": (options.format if options and options.format else None) or {"type": "text"},
                                "verbosity": (options.verbosity if options else None) or "medium"}
        return cls({
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "max_tool_calls": req.max_tool_calls,
            "model": model,
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id,
            "prompt_cache_key": req.prompt_cache_key,
            "prompt_cache_retention": req.prompt_cache_retention,
            "reasoning": {"effort": reasoning.effort if reasoning else None,
                          "summary": reasoning.summary if reasoning else None},
            "safety_identifier": req.safety_identifier,
            "service_tier": "default",
            "store": req.store is not False,
            "temperature": req.temperature,
            "text": text,
            "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
            "tools": req.tools or [],
            "top_logprobs": 0,
            "top_p": req.top_p,
            "truncation": "disabled",
            "user": req.user,
            "metadata": req.metadata or {},
        })


class Turn:
    """One generation: the pipeline's choice events in, Items, events and usage out."""

    def __init__(self, response_id: str, echo: Echo, choice: ChoiceProgress,
                 identities: dict[str, ToolIdentity], include: Optional[list[str]]):
        self.id = response_id
        self.created_at = int(time.time())
        self.echo = echo
        self.choice = choice
        self.output = OutputAssembler(identities, seal_reasoning=ENCRYPTED_REASONING in (include or []))

    @property
    def output_ids(self) -> list[int]:
        return self.choice.output_ids

    @property
    def finish_reason(self) -> Optional[str]:
        return self.choice.finish_reason

    def feed(self, event: ChoiceEvent) -> list[Event]:
        """Render one choice event; returns the semantic events it released."""
        events = self.output.feed(event.deltas)
        if event.finished:
            events += self.output.finish(self.status)
        return events

    @property
    def status(self) -> str:
        if self.finish_reason is None:
            return "in_progress"
        return "incomplete" if self.finish_reason == "length" else "completed"

    def usage(self) -> dict[str, Any]:
        c = self.choice
        return {
            "input_tokens": c.prompt_tokens,
            "input_tokens_details": {"cached_tokens": c.cached_tokens},
            "output_tokens": c.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": c.reasoning_tokens},
            "total_tokens": c.prompt_tokens + c.completion_tokens,
        }

    def response(self, error: Optional[NinferError] = None) -> dict[str, Any]:
        """The Response object now: in progress, terminal, or failed with ``error``."""
        status = "failed" if error is not None else self.status
        terminal = status != "in_progress"
        body: dict[str, Any] = {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "background": False,
            "completed_at": int(time.time()) if status == "completed" else None,
            "error": {"code": error.code, "message": error.message} if error is not None else None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        }
        body.update(self.echo.fields)
        body["output"] = self.output.snapshot() if error is not None else list(self.output.items)
        body["usage"] = self.usage() if terminal else None
        return body
