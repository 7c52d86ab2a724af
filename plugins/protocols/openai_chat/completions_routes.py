"""The /v1/completions route and what it needs: imported only when the server builds its app.

See :mod:`ninfer_plugins.protocols.openai_chat.completions` for the behaviour.
"""

from __future__ import annotations

import time
from contextlib import aclosing
from typing import TYPE_CHECKING, Any, AsyncIterator, Optional, Union

import attrs
import msgspec
from litestar import Request, Response, post
from msgspec import UNSET, Struct, UnsetType

from ninfer.errors import InvalidRequestError, UnsupportedFeatureError
from ninfer.frontend.pipeline import Pipeline, Run
from ninfer.frontend.pipeline_request import GenerateRequest, TextPrompt
from ninfer.sampling_params import SamplingParams
from ninfer.sampling_schema import Limits
from ninfer.sampling_wire import WireField
from ninfer.server.body import parse_body
from ninfer.server.disconnect import cancel_on_disconnect
from ninfer.server.openapi import (
    GENERATION_ERRORS,
    ErrorResponse,
    error_responses,
    event_stream_operation,
    json_response,
)
from ninfer.server.sse import sse_response
from ninfer_plugins.protocols.openai_chat.choice import finish_reason, timings, token_text
from ninfer_plugins.protocols.openai_chat.schema import (
    SAMPLING as CHAT_SAMPLING,
    CompletionTokensDetails,
    PromptTokensDetails,
    StreamOptions,
    Timings,
    Usage,
    encoder,
)

if TYPE_CHECKING:
    from ninfer.server.state import ServerState

MAX_LOGPROBS = 5
#: more than chat's four: evaluation harnesses send a task's stop list plus the EOS text
MAX_STOP = 32
JSON = "application/json"
#: the chat request's sampling fields, ranges and messages, but for the legacy spellings:
#: one max_tokens (16 when absent, as OpenAI's), logprobs as a count, more stop strings
SAMPLING = CHAT_SAMPLING.evolve(
    WireField("max_tokens", absent=16),
    WireField("stop", max_items=MAX_STOP),
    WireField("logprobs", limits=Limits(0, MAX_LOGPROBS)),
    drop=("max_completion_tokens", "top_logprobs"),
)


class CompletionRequest(SAMPLING.struct("CompletionSampling", module=__name__, kw_only=True), kw_only=True):
    """The sampling fields come from :data:`SAMPLING`."""

    #: a string, a list of strings, a list of token ids, or a list of token-id lists
    prompt: Union[str, list[Any]]
    model: Optional[str] = None
    best_of: Optional[int] = None
    echo: Optional[bool] = None
    suffix: Optional[str] = None
    stream: Optional[bool] = None
    stream_options: Optional[StreamOptions] = None
    user: Optional[str] = None


class LegacyLogprobs(Struct):
    tokens: list[str]
    token_logprobs: list[Optional[float]]
    top_logprobs: list[Optional[dict[str, float]]]
    text_offset: list[int]


class CompletionChoice(Struct):
    index: int
    text: str
    finish_reason: Optional[str]
    logprobs: Optional[LegacyLogprobs] = None


class Completion(Struct):
    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Union[Usage, None, UnsetType] = UNSET
    timings: Union[Timings, UnsetType] = UNSET
    object: str = "text_completion"
    system_fingerprint: Optional[str] = None


def _prompts(prompt: Union[str, list[Any]], vocab_size: int) -> list[Union[str, list[int]]]:
    """Normalise the four prompt spellings to a list of strings and id lists; token ids
    must lie inside the vocabulary (they are decoded for echo before the engine sees them)."""
    if isinstance(prompt, str):
        return [prompt]
    if prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        _check_ids(prompt, vocab_size, "prompt")
        return [list(prompt)]
    out: list[Union[str, list[int]]] = []
    for i, item in enumerate(prompt):
        ok = isinstance(item, str) or (
            isinstance(item, list) and item and all(isinstance(t, int) and not isinstance(t, bool) for t in item))
        if not ok:
            raise InvalidRequestError("prompt items must be strings or non-empty token-id lists", param=f"prompt[{i}]")
        if isinstance(item, list):
            _check_ids(item, vocab_size, f"prompt[{i}]")
        out.append(item)
    if not out:
        raise InvalidRequestError("prompt must not be empty", param="prompt")
    return out


def _check_ids(ids: list[int], vocab_size: int, param: str) -> None:
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidRequestError(f"token id {bad} is outside the vocabulary (0..{vocab_size - 1})", param=param)


def _validate(req: CompletionRequest) -> None:
    if req.suffix:
        raise UnsupportedFeatureError("suffix (insertion) is not supported", param="suffix")
    if req.best_of is not None and req.best_of != (req.n or 1):
        raise UnsupportedFeatureError("best_of other than n is not supported", param="best_of")


def _params(req: CompletionRequest, vocab_size: int) -> SamplingParams:
    values = SAMPLING.params(req, vocab_size=vocab_size)
    values.pop("n", None)  # each choice is its own engine request
    if req.echo and req.logprobs is not None:  # echo with log probabilities scores the prompt too
        values["prompt_logprobs"] = req.logprobs
    return SamplingParams(**values)


def _legacy_logprobs(tokenizer: Any, positions: list[Any], offset: int,
                     prompt: Optional[tuple[list[int], list[Any]]] = None) -> LegacyLogprobs:
    """Positions in the legacy shape; offsets count characters of the returned text.

    ``prompt`` (echo): the prompt's token ids and log probabilities, listed first from
    offset 0; the generated ``positions`` start at ``offset`` (the echoed text's length).
    """
    out = LegacyLogprobs([], [], [], [])
    if prompt is not None:
        at = 0
        for token_id, pos in zip(*prompt):
            at += _add_position(out, token_text(tokenizer, token_id), pos, at)
    for pos in positions:
        offset += _add_position(out, token_text(tokenizer, pos.token_id), pos, offset)
    return out


def _add_position(out: LegacyLogprobs, text: str, pos: Any, offset: int) -> int:
    """Append one token (``pos`` None: the prompt's first, unscored); returns its length."""
    top = None
    if pos is not None:
        top = {t.token: t.logprob for t in pos.top}
        top.setdefault(text, pos.logprob)  # the token itself is always listed
    out.tokens.append(text)
    out.token_logprobs.append(None if pos is None else pos.logprob)
    out.top_logprobs.append(top)
    out.text_offset.append(offset)
    return len(text)


@attrs.define
class _Answer:
    """Renders one pipeline run (prompt-major, ``n`` choices per prompt) in the legacy shape."""

    run: Run
    tokenizer: Any
    id: str
    model: str
    echo: list[str]  # text put before each choice's output
    want_logprobs: bool
    scores_prompt: bool = False  # echo with log probabilities: the prompt's own lead each choice's
    created: int = attrs.field(factory=lambda: int(time.time()))

    def piece(self, k: int, text: str, positions: list[Any], offset: int, finish: Optional[str],
              prompt_logprobs: Optional[list[Any]] = None) -> CompletionChoice:
        lp = None
        if self.want_logprobs:
            prompt = None if prompt_logprobs is None else (self.run.requests[k].prompt_token_ids, prompt_logprobs)
            lp = _legacy_logprobs(self.tokenizer, positions, offset, prompt)
        return CompletionChoice(k, text, finish, lp)

    def envelope(self, choices: list[CompletionChoice], final: bool = False) -> Completion:
        out = Completion(self.id, self.created, self.model, choices)
        if final:
            counts = self.run.usage()
            out.usage = Usage(counts.prompt_tokens, counts.completion_tokens, counts.total_tokens,
                              PromptTokensDetails(counts.cached_tokens), CompletionTokensDetails(0))
            out.timings = timings(self.run.choices)
        return out

    async def aggregate(self) -> bytes:
        texts = [[e] for e in self.echo]
        positions: list[list[Any]] = [[] for _ in self.run.choices]
        prompts: list[Optional[list[Any]]] = [None for _ in self.run.choices]
        async with aclosing(self.run.events()) as events:
            async for event in events:
                k = event.index
                texts[k] += [d.text for d in event.deltas]
                positions[k] += event.logprobs or []
                prompts[k] = event.prompt_logprobs if event.prompt_logprobs is not None else prompts[k]
        out = [self.piece(k, "".join(texts[k]), positions[k], len(self.echo[k]), finish_reason(c),
                          prompts[k] if self.scores_prompt else None)
               for k, c in enumerate(self.run.choices)]
        return encoder.encode(self.envelope(out, final=True))

    async def frames(self, include_usage: bool) -> AsyncIterator[bytes]:
        offsets = [len(e) for e in self.echo]
        pending_echo = list(self.echo)
        async with aclosing(self.run.events()) as events:
            async for event in events:
                k = event.index
                text = "".join(d.text for d in event.deltas)
                prompt = event.prompt_logprobs if self.scores_prompt else None
                # a scored echo waits for the event that carries the prompt's log probabilities
                if not self.scores_prompt or prompt is not None or event.finished:
                    text, pending_echo[k] = pending_echo[k] + text, ""
                finish = finish_reason(event.choice) if event.finished else None
                if text or finish or event.logprobs or prompt is not None:
                    chunk = self.piece(k, text, event.logprobs or [], offsets[k], finish, prompt)
                    if event.logprobs:  # the next generated token starts where this chunk's last ends
                        offsets[k] = chunk.logprobs.text_offset[-1] + len(chunk.logprobs.tokens[-1])
                    yield _frame(self.envelope([chunk]))
        if include_usage:
            yield _frame(self.envelope([], final=True))
        yield b"data: [DONE]\n\n"


def _frame(chunk: Completion) -> bytes:
    return b"data: " + encoder.encode(chunk) + b"\n\n"


def completion_routes(state: ServerState) -> list:
    tokenizer = state.tokenizer
    pipeline = Pipeline(state)

    def parse(body: bytes) -> tuple[CompletionRequest, GenerateRequest]:
        data = msgspec.json.decode(body, type=CompletionRequest)  # strict types: see ninfer.server.body
        state.check_model(data.model)
        prompts = _prompts(data.prompt, state.vocab_size)
        _validate(data)
        params = _params(data, state.vocab_size)
        prompts = [TextPrompt(text=p) if isinstance(p, str) else TextPrompt(token_ids=p) for p in prompts]
        return data, GenerateRequest(prompts, params, n=data.n or 1, lora=state.lora_for(data.model),
                                     prompt_param="prompt")

    @post("/v1/completions", summary="Create a text completion (legacy)", tags=["OpenAI"], status_code=200,
          description="OpenAI's legacy completions on a raw prompt; `stream: true` answers with server-sent events.",
          responses={200: json_response(Completion, "The completion, or (stream: true) server-sent events: "
                                        "text_completion chunks, then [DONE]"),
                     **error_responses(*GENERATION_ERRORS)},
          operation_class=event_stream_operation(Completion, ErrorResponse, body=CompletionRequest))
    async def create_completion(request: Request) -> Response:
        data, req = await parse_body(request, parse)
        run = await pipeline.prepare(req, stream=bool(data.stream))
        n = req.n
        echo = [run.prompts[k // n].text if data.echo else "" for k in range(len(run.choices))]
        answer = _Answer(run, tokenizer, f"cmpl-{run.request_id}", data.model or state.model_id, echo,
                         data.logprobs is not None, req.params.prompt_logprobs is not None)
        if data.stream:
            return sse_response(answer.frames(bool(data.stream_options and data.stream_options.include_usage)))
        return Response(await cancel_on_disconnect(request, answer.aggregate()), media_type=JSON)

    return [create_completion]
