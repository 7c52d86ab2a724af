"""Guided decoding on llguidance: every guide kind, batched masks, a compile cache.

docs/guided-decoding.md explains the choice of library. The tokenizer adapter hands
llguidance the checkpoint's own ``tokenizer.json`` (the same file ninfer tokenizes
with), the model's vocabulary width (padding rows of the embedding are never allowed)
and the generation end-of-sequence ids, which the masks allow once a guide may end.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from typing import Sequence

import llguidance
import torch

from ninfer.capabilities import GuidedDecodingBackend
from ninfer.errors import InvalidRequestError
from ninfer.guided.spec import GuideSpec
from ninfer.hookspecs import hookimpl
from ninfer_plugins.guided.llguidance_grammar import SpecialTokens, grammar_for

#: compiled guides kept for reuse (requests of one batch or agent loop repeat their schema)
CACHE_ENTRIES = 256
#: longest compile error passed back to the client (llguidance appends parser state dumps)
MAX_ERROR_CHARS = 600
#: how a compile error names what failed, by guide kind
_WHAT = {"json_object": "json schema", "json_schema": "json schema", "regex": "regex", "ebnf": "grammar",
         "lark": "grammar", "choice": "choice list", "structural_tag": "structural tag"}


def make_tokenizer(tokenizer, vocab_size: int) -> llguidance.LLTokenizer:
    """llguidance's view of a :class:`ninfer.tokenizer.Tokenizer` (built once per engine)."""
    return llguidance.LLTokenizer(
        tokenizer.backend.to_str(), n_vocab=vocab_size, eos_token=list(tokenizer.eos_token_ids)
    )


def _added_tokens(tokenizer) -> dict[str, int]:
    return {tok.content: i for i, tok in tokenizer.backend.get_added_tokens_decoder().items()}


def _canonical(value) -> str:
    """Cache key text; key order is kept because llguidance emits properties in schema order."""
    return value if isinstance(value, str) else json.dumps(value, separators=(",", ":"), ensure_ascii=False)


class LLGuidanceCompiler:
    """A :class:`ninfer.guided.backend.GuideCompiler` on llguidance."""

    name = "llguidance"

    def __init__(self, tokenizer, vocab_size: int):
        self.tokenizer = make_tokenizer(tokenizer, vocab_size)
        self.special = SpecialTokens(_added_tokens(tokenizer))
        # a thread pool of its own: a batch's mask rows are computed in parallel, without the GIL
        self.executor = llguidance.LLExecutor()
        self._cache: OrderedDict[tuple[str, str], llguidance.LLMatcher] = OrderedDict()

    def matcher(self, spec: GuideSpec) -> llguidance.LLMatcher:
        key = (spec.kind, _canonical(spec.value))
        pristine = self._cache.get(key)
        if pristine is None:
            pristine = self._compile(spec)
            self._cache[key] = pristine
            if len(self._cache) > CACHE_ENTRIES:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(key)
        return pristine.deep_copy()

    def _compile(self, spec: GuideSpec) -> llguidance.LLMatcher:
        grammar = grammar_for(spec, self.special)
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            message = matcher.get_error().strip()
            if len(message) > MAX_ERROR_CHARS:
                message = message[:MAX_ERROR_CHARS] + "..."
            raise InvalidRequestError(f"invalid {_WHAT[spec.kind]}: {message}", param=spec.param)
        return matcher

    def fill_bitmask(self, matchers: Sequence[llguidance.LLMatcher], bitmask: torch.Tensor, parallel: bool) -> None:
        if not (bitmask.dtype == torch.int32 and bitmask.device.type == "cpu" and bitmask.is_contiguous()):
            raise ValueError("the bitmask must be a contiguous int32 host tensor")
        rows, words = bitmask.shape
        if len(matchers) > rows:
            raise ValueError(f"{len(matchers)} matchers but only {rows} bitmask rows")
        if parallel and len(matchers) > 1:
            self.executor.unsafe_compute_mask_ptr(
                [(m, i) for i, m in enumerate(matchers)], bitmask.data_ptr(), words * 4, rows
            )
            return
        # Waking the pool costs more than it saves for one row, and on a CPU-only host
        # torch's spinning worker threads hold the cores: then the calling thread is faster.
        for i, m in enumerate(matchers):
            m.unsafe_compute_mask_ptr(bitmask[i].data_ptr(), words * 4)


@hookimpl
def register_guided_decoding_backends(register):
    register(GuidedDecodingBackend(
        name="llguidance",
        description="JSON schema, regex, GBNF/lark grammars, choices and structural tags (llguidance)",
        factory=LLGuidanceCompiler,
    ))
