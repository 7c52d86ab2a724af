"""The Response object: request echo, status, output Items and usage."""

from __future__ import annotations

import time
import uuid
from typing import Any, Optional

import attrs

from ninfer.engine.request import GenerationEvent
from ninfer.errors import NinferError
from ninfer.frontend.output_split import OutputSplitter
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
    """One generation: engine events in, Items, events and usage out."""

    def __init__(self, response_id: str, echo: Echo, splitter: OutputSplitter,
                 identities: dict[str, ToolIdentity], include: Optional[list[str]]):
        self.id = response_id
        self.created_at = int(time.time())
        self.echo = echo
        self.splitter = splitter
        self.output = OutputAssembler(identities, seal_reasoning=ENCRYPTED_REASONING in (include or []))
        self.prompt_tokens = self.cached_tokens = self.output_tokens = 0
        self.output_ids: list[int] = []
        self.finish_reason: Optional[str] = None

    def feed(self, event: GenerationEvent) -> list[Event]:
        """Account one engine event; returns the semantic events it released."""
        if event.error is not None:
            raise event.error
        self.prompt_tokens, self.cached_tokens = event.num_prompt_tokens, event.num_cached_tokens
        self.output_tokens = event.num_output_tokens
        self.output_ids += event.token_ids
        events = []
        if event.text or event.token_ids:
            events = self.output.feed(self.splitter.feed(event.text, len(event.token_ids)))
        if event.finished:
            self.finish_reason = event.finish_reason
            events += self.output.feed(self.splitter.finish())
            events += self.output.finish(self.status)
        return events

    @property
    def status(self) -> str:
        if self.finish_reason is None:
            return "in_progress"
        return "incomplete" if self.finish_reason == "length" else "completed"

    def usage(self) -> dict[str, Any]:
        return {
            "input_tokens": self.prompt_tokens,
            "input_tokens_details": {"cached_tokens": self.cached_tokens},
            "output_tokens": self.output_tokens,
            "output_tokens_details": {"reasoning_tokens": self.splitter.reasoning_tokens},
            "total_tokens": self.prompt_tokens + self.output_tokens,
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
