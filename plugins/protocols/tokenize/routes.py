"""POST /tokenize and POST /detokenize (vLLM's shapes, OpenAI's error shape)."""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING, Any

import msgspec
from litestar import Request, Response, post

from ninfer.errors import InvalidRequestError, UnsupportedFeatureError
from ninfer.frontend.chat_messages import parse_messages
from ninfer.frontend.pipeline import Pipeline
from ninfer.frontend.pipeline_request import ChatPrompt, TemplateOptions
from ninfer.server.body import parse_body
from ninfer.server.openapi import BODY_ERRORS, documented, error_responses, json_response, self_contained_schema
from ninfer_plugins.protocols.tokenize.schema import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
    encoder,
)

if TYPE_CHECKING:
    from ninfer.server.state import ServerState

JSON = "application/json"
#: chat_template_kwargs the template renders with (the ones Chat Completions takes)
TEMPLATE_KWARGS = ("enable_thinking", "preserve_thinking")


def tokenize_routes(state: ServerState) -> list:
    tokenizer = state.tokenizer
    pipeline = Pipeline(state)

    def parse_tokenize(body: bytes) -> TokenizeCompletionRequest | TokenizeChatRequest:
        req = _decode_tokenize(msgspec.json.decode(body))  # malformed JSON: a 400
        state.check_model(req.model)
        return req

    def parse_detokenize(body: bytes) -> DetokenizeRequest:
        req = msgspec.json.decode(body, type=DetokenizeRequest, strict=True)
        state.check_model(req.model)
        return req

    @post("/tokenize", summary="Tokenize a prompt or a chat", tags=["vLLM"], status_code=200,
          description="vLLM's tokenizer endpoint: `prompt` is tokenized as given, `messages` through the chat "
                      "template as Chat Completions renders them.",
          responses={200: json_response(TokenizeResponse, "the token ids"), **error_responses(*BODY_ERRORS, 404)},
          operation_class=documented(body=self_contained_schema(TokenizeCompletionRequest, TokenizeChatRequest)))
    async def tokenize(request: Request) -> Response:
        req = await parse_body(request, parse_tokenize)
        ids = await state.run_blocking(_token_ids, req, pipeline)
        strs = [tokenizer.id_to_token(i) or "" for i in ids] if req.return_token_strs else None
        out = TokenizeResponse(count=len(ids), max_model_len=state.max_model_len, tokens=ids, token_strs=strs)
        return Response(encoder.encode(out), media_type=JSON)

    @post("/detokenize", summary="Detokenize token ids", tags=["vLLM"], status_code=200,
          description="The text of the token ids, special tokens included.",
          responses={200: json_response(DetokenizeResponse, "the text"), **error_responses(*BODY_ERRORS, 404)},
          operation_class=documented(body=DetokenizeRequest))
    async def detokenize(request: Request) -> Response:
        req = await parse_body(request, parse_detokenize)
        vocab = tokenizer.vocab_size
        for i, token in enumerate(req.tokens):
            if not 0 <= token < vocab:
                raise InvalidRequestError(f"token id {token} is outside the vocabulary (0..{vocab - 1})",
                                          param=f"tokens[{i}]")
        text = await state.run_blocking(tokenizer.decode, req.tokens, False)
        return Response(encoder.encode(DetokenizeResponse(prompt=text)), media_type=JSON)

    return [tokenize, detokenize]


def _decode_tokenize(body: Any) -> TokenizeCompletionRequest | TokenizeChatRequest:
    if not isinstance(body, dict):
        raise InvalidRequestError("the body must be a JSON object with `prompt` or `messages`")
    if ("prompt" in body) == ("messages" in body):
        raise InvalidRequestError("give exactly one of `prompt` (raw text) and `messages` (a chat)",
                                  param="prompt" if "prompt" in body else "messages")
    kind = TokenizeChatRequest if "messages" in body else TokenizeCompletionRequest
    return msgspec.convert(body, kind, strict=True)  # a wrong type is a 400 naming the field


def _token_ids(req: TokenizeCompletionRequest | TokenizeChatRequest, pipeline: Pipeline) -> list[int]:
    """Blocking (template rendering and tokenizing): runs off the event loop."""
    tokenizer = pipeline.tokenizer
    if isinstance(req, TokenizeCompletionRequest):
        return tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
    return pipeline.render(_chat_prompt(req, tokenizer)).token_ids


def _chat_prompt(req: TokenizeChatRequest, tokenizer: Any) -> ChatPrompt:
    """The chat as Chat Completions renders it; the pipeline's render checks the options and
    turns a template's refusal into a 400."""
    if req.add_generation_prompt and req.continue_final_message:
        raise InvalidRequestError("add_generation_prompt and continue_final_message cannot both be true: the "
                                  "first opens a new assistant turn, the second continues the last message",
                                  param="continue_final_message")
    kwargs = req.chat_template_kwargs or {}
    for key in kwargs:
        if key not in TEMPLATE_KWARGS:
            raise UnsupportedFeatureError(f"chat_template_kwargs.{key} is not supported (only "
                                          f"{', '.join(TEMPLATE_KWARGS)})", param=f"chat_template_kwargs.{key}")
        if not isinstance(kwargs[key], bool):
            raise InvalidRequestError(f"{key} must be a boolean", param=f"chat_template_kwargs.{key}")
    options = TemplateOptions(enable=kwargs.get("enable_thinking"), preserve=kwargs.get("preserve_thinking"))
    return ChatPrompt(parse_messages(req.messages), _tools(req.tools), options,
                      continue_final=req.continue_final_message, add_generation_prompt=req.add_generation_prompt,
                      encode=partial(tokenizer.encode, add_special_tokens=req.add_special_tokens))


def _tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """OpenAI-shaped function tools, checked as far as the template relies on them."""
    for i, tool in enumerate(tools or []):
        fn = tool.get("function")
        if tool.get("type") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise InvalidRequestError("each tool must be {\"type\": \"function\", \"function\": {\"name\": ...}}",
                                      param=f"tools[{i}]")
    return list(tools or [])
