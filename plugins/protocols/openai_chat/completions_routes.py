"""The /v1/completions route and what it needs: imported only when the server builds its app.

See :mod:`ninfer_plugins.protocols.openai_chat.completions` for the behaviour.
"""

from __future__ import annotations

import time
from contextlib import aclosing
from typing import Any, AsyncIterator, Optional, Union

import attrs
from litestar import Request, Response, post
from msgspec import UNSET, Struct, UnsetType

from ninfer.engine.request import EngineRequest
from ninfer.errors import InvalidRequestError, UnsupportedFeatureError
from ninfer.frontend.fanout import generate_all
from ninfer.frontend.prompt_limits import check_prompt_length
from ninfer.sampling_params import SamplingParams
from ninfer.sampling_schema import Limits
from ninfer.sampling_wire import WireField
from ninfer.server.admission import request_id
from ninfer.server.body import strict_body
from ninfer.server.disconnect import cancel_on_disconnect
from ninfer.server.openapi import ErrorResponse, error_responses, event_stream_operation, json_response
from ninfer.server.sse import sse_response
from ninfer_plugins.protocols.openai_chat.choice import ChoiceState, timings
from ninfer_plugins.protocols.openai_chat.schema import (
    SAMPLING as CHAT_SAMPLING,
    CompletionTokensDetails,
    PromptTokensDetails,
    StreamOptions,
    Timings,
    Usage,
    encoder,
)

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


def _legacy_logprobs(choice: ChoiceState, positions: list[Any], offset: int,
                     prompt: Optional[tuple[list[int], list[Any]]] = None) -> LegacyLogprobs:
    """Positions in the legacy shape; offsets count characters of the returned text.

    ``prompt`` (echo): the prompt's token ids and log probabilities, listed first from
    offset 0; the generated ``positions`` start at ``offset`` (the echoed text's length).
    """
    out = LegacyLogprobs([], [], [], [])
    if prompt is not None:
        at = 0
        for token_id, pos in zip(*prompt):
            at += _add_position(out, choice.token_text(token_id), pos, at)
    for pos in positions:
        offset += _add_position(out, choice.token_text(pos.token_id), pos, offset)
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
class _Run:
    """One HTTP request's engine requests (prompt-major, ``n`` per prompt) and their state."""

    state: Any
    id: str
    model: str
    requests: list[EngineRequest]
    choices: list[ChoiceState]
    n: int
    echo: list[str]  # text put before each choice's output
    want_logprobs: bool
    scores_prompt: bool = False  # echo with log probabilities: the prompt's own lead each choice's
    created: int = attrs.field(factory=lambda: int(time.time()))

    def piece(self, k: int, text: str, positions: list[Any], offset: int, finish: Optional[str],
              prompt_logprobs: Optional[list[Any]] = None) -> CompletionChoice:
        lp = None
        if self.want_logprobs:
            prompt = None if prompt_logprobs is None else (self.requests[k].prompt_token_ids, prompt_logprobs)
            lp = _legacy_logprobs(self.choices[k], positions, offset, prompt)
        return CompletionChoice(k, text, finish, lp)

    def envelope(self, choices: list[CompletionChoice], final: bool = False) -> Completion:
        out = Completion(self.id, self.created, self.model, choices)
        if final:
            out.usage, out.timings = self.usage(), timings(self.choices)
        return out

    def usage(self) -> Usage:
        heads = self.choices[:: self.n]  # a prompt's counts, once per prompt
        prompt = sum(c.prompt_tokens for c in heads)
        completion = sum(c.completion_tokens for c in self.choices)
        return Usage(prompt, completion, prompt + completion, PromptTokensDetails(sum(c.cached_tokens for c in heads)),
                     CompletionTokensDetails(0))

    async def aggregate(self) -> bytes:
        texts = [[e] for e in self.echo]
        positions: list[list[Any]] = [[] for _ in self.requests]
        prompts: list[Optional[list[Any]]] = [None for _ in self.requests]
        async with aclosing(generate_all(self.state, self.requests)) as events:
            async for k, event in events:
                texts[k] += [d.text for d in self.choices[k].feed(event)]
                positions[k] += event.logprobs or []
                prompts[k] = event.prompt_logprobs if event.prompt_logprobs is not None else prompts[k]
        out = [self.piece(k, "".join(texts[k]), positions[k], len(self.echo[k]), c.finish_reason,
                          prompts[k] if self.scores_prompt else None)
               for k, c in enumerate(self.choices)]
        return encoder.encode(self.envelope(out, final=True))

    async def frames(self, include_usage: bool) -> AsyncIterator[bytes]:
        offsets = [len(e) for e in self.echo]
        pending_echo = list(self.echo)
        async with aclosing(generate_all(self.state, self.requests)) as events:
            async for k, event in events:
                text = "".join(d.text for d in self.choices[k].feed(event))
                prompt = event.prompt_logprobs if self.scores_prompt else None
                # a scored echo waits for the event that carries the prompt's log probabilities
                if not self.scores_prompt or prompt is not None or event.finished:
                    text, pending_echo[k] = pending_echo[k] + text, ""
                finish = self.choices[k].finish_reason if event.finished else None
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


def completion_routes(state: Any) -> list:
    tokenizer = state.tokenizer
    vocab_size = state.engine.engine.vocab_size

    @post("/v1/completions", summary="Create a text completion (legacy)", tags=["OpenAI"], status_code=200,
          description="OpenAI's legacy completions on a raw prompt; `stream: true` answers with server-sent events.",
          responses={200: json_response(Completion, "The completion, or (stream: true) server-sent events: "
                                        "text_completion chunks, then [DONE]"),
                     **error_responses(400, 404, 413, 429, 500, 503)},
          operation_class=event_stream_operation(Completion, ErrorResponse))
    async def create_completion(request: Request, data: CompletionRequest) -> Response:
        data = await strict_body(request, CompletionRequest)  # strict types: see ninfer.server.body
        state.check_model(data.model)
        prompts = _prompts(data.prompt, vocab_size)
        _validate(data)
        params = _params(data, vocab_size)
        n = data.n or 1
        state.gate.reserve()
        encoded = [await state.run_blocking(tokenizer.encode, p) if isinstance(p, str) else p for p in prompts]
        for ids in encoded:
            check_prompt_length(len(ids), state.max_model_len, param="prompt")
        texts = [p if isinstance(p, str) else await state.run_blocking(tokenizer.decode, p, False) for p in prompts]
        rid = request_id()
        lora = state.lora_for(data.model)
        requests = [EngineRequest(f"{rid}-{i * n + j}", ids, params, prompt=texts[i], lora_name=lora, sample_index=j)
                    for i, ids in enumerate(encoded) for j in range(n)]
        run = _Run(state, f"cmpl-{rid}", data.model or state.model_id, requests,
                   [ChoiceState(k, tokenizer) for k in range(len(requests))], n,
                   [texts[k // n] if data.echo else "" for k in range(len(requests))], data.logprobs is not None,
                   params.prompt_logprobs is not None)
        if data.stream:
            return sse_response(run.frames(bool(data.stream_options and data.stream_options.include_usage)))
        return Response(await cancel_on_disconnect(request, run.aggregate()), media_type=JSON)

    return [create_completion]
