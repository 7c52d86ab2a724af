"""The text front end: a checkpoint's tokenizer and chat template, without transformers.

Token work goes through the ``tokenizers`` library; chat templates are rendered with a
sandboxed jinja2 environment configured the way ``transformers`` configures its own, so
a template renders to the same string here as with ``apply_chat_template``. The API is
synchronous on purpose: async callers run it in a worker thread.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.parser import Parser
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as Backend

#: message fields that carry reasoning text; the first is the one templates read
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")


# -- jinja environment ------------------------------------------------------------------


class _GenerationTag(Extension):
    """Accept ``{% generation %}...{% endgeneration %}`` (an assistant-mask marker
    some templates carry) and render its body unchanged."""

    tags = {"generation"}

    def parse(self, parser: Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False
) -> str:
    # jinja's own tojson sorts keys and HTML-escapes; templates expect plain JSON in key order
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=16)
def compile_template(source: str) -> jinja2.Template:
    """Compile a chat template in an environment matching transformers' (cached by source)."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, "jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def _prepare_message(message: Mapping[str, Any]) -> dict[str, Any]:
    """Drop ``None`` fields and fill ``reasoning_content``/``thinking`` from whichever
    reasoning field is set, as transformers does before rendering."""
    out = {k: v for k, v in message.items() if v is not None}
    reasoning = next((out[k] for k in _REASONING_FIELDS if k in out), None)
    if reasoning is not None:
        out = {"thinking": reasoning, **out, "reasoning_content": reasoning}
    return out


# -- file reading -------------------------------------------------------------------------


def _token_content(value: Any) -> str | None:
    """Special tokens appear as plain strings or as AddedToken dicts in tokenizer_config."""
    if isinstance(value, Mapping):
        return value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _load_templates(model_dir: Path, config: Mapping[str, Any]) -> dict[str, str]:
    """Named templates; the standalone chat_template.jinja wins over the config entry."""
    jinja_file = model_dir / "chat_template.jinja"
    if jinja_file.is_file():
        return {"default": jinja_file.read_text(encoding="utf-8")}
    raw = config.get("chat_template")
    if isinstance(raw, str):
        return {"default": raw}
    if isinstance(raw, list):
        return {item["name"]: item["template"] for item in raw}
    return {}


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """Inverse of the GPT-2 byte-to-printable-character table byte-level BPEs use."""
    # printable Latin-1 bytes stand for themselves; the rest map to code points from 256 up
    byte_values = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = list(byte_values)
    shifted = 0
    for b in range(256):
        if b not in byte_values:
            byte_values.append(b)
            chars.append(256 + shifted)
            shifted += 1
    return {chr(c): b for b, c in zip(byte_values, chars)}


def _uses_byte_level(backend: Backend) -> bool:
    def walk(node: Any) -> Iterator[str]:
        if isinstance(node, Mapping):
            yield str(node.get("type"))
            for child in node.get("decoders") or ():
                yield from walk(child)

    decoder = backend.decoder
    return decoder is not None and "ByteLevel" in walk(json.loads(decoder.__getstate__()))


# -- the tokenizer ----------------------------------------------------------------------


#: texts longer than this are tokenized without holding the GIL (below it the single
#: call's lower overhead wins, and it takes well under a millisecond)
GIL_FREE_CHARS = 16_384


class Tokenizer:
    """A checkpoint's tokenizer plus chat template."""

    def __init__(
        self,
        backend: Backend,
        *,
        templates: Mapping[str, str] | None = None,
        special_tokens: Mapping[str, str] | None = None,
        generation_eos_ids: Sequence[int] = (),
    ):
        self.backend = backend
        self.templates = dict(templates or {})
        #: bos/eos/unk/pad token strings, also visible to chat templates
        self.special_tokens = dict(special_tokens or {})
        self._byte_level = _uses_byte_level(backend)
        self._bytes_cache: dict[int, bytes] = {}
        added = backend.get_added_tokens_decoder()
        self.special_token_ids: set[int] = {i for i, tok in added.items() if tok.special}
        eos = self.special_tokens.get("eos_token")
        eos_ids = [*generation_eos_ids, *([backend.token_to_id(eos)] if eos else [])]
        #: every id that ends generation, generation_config's first
        self.eos_token_ids: list[int] = list(dict.fromkeys(i for i in eos_ids if i is not None))

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> "Tokenizer":
        model_dir = Path(model_dir)
        backend = Backend.from_file(str(model_dir / "tokenizer.json"))
        config = _read_json(model_dir / "tokenizer_config.json")
        special = {k: c for k in _SPECIAL_TOKEN_KEYS if (c := _token_content(config.get(k)))}
        gen_eos = _read_json(model_dir / "generation_config.json").get("eos_token_id")
        gen_eos_ids = [] if gen_eos is None else [gen_eos] if isinstance(gen_eos, int) else list(gen_eos)
        return cls(
            backend,
            templates=_load_templates(model_dir, config),
            special_tokens=special,
            generation_eos_ids=gen_eos_ids,
        )

    # -- tokens ---------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        if len(text) > GIL_FREE_CHARS:
            # tokenizers' single encode holds the GIL throughout (seconds for megabytes), so
            # even from a worker thread it would stall the server's event loop; the batch
            # call releases it and gives the same ids
            return self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def token_bytes(self, token_id: int) -> bytes:
        """The exact bytes one token contributes to the text (may be part of a character).

        Ids past the tokenizer's vocabulary (padding rows of a model's embedding) decode
        to nothing, so they contribute no bytes.
        """
        cached = self._bytes_cache.get(token_id)
        if cached is None:
            cached = self._bytes_cache[token_id] = self._compute_bytes(token_id)
        return cached

    def _compute_bytes(self, token_id: int) -> bytes:
        token = self.backend.id_to_token(token_id)
        if token is None:
            return b""
        if self._byte_level:
            table = _byte_decoder()
            # the byte-level decoder keeps a token's own UTF-8 when any character is unmapped
            if all(c in table for c in token):
                return bytes(table[c] for c in token)
            return token.encode("utf-8")
        return self.backend.decode([token_id], skip_special_tokens=False).encode("utf-8")

    # -- chat -----------------------------------------------------------------------------
    @property
    def chat_template_source(self) -> str:
        """The default chat template's text ("" when the checkpoint has none)."""
        return self.templates.get("default", "")

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool | None = None,
        continue_final_message: bool = False,
        **template_kwargs: Any,
    ) -> str:
        """Render a conversation to prompt text (special markers included, not tokenized).

        ``add_generation_prompt`` defaults to opening a new assistant turn. With
        ``continue_final_message`` the last message is left open instead, so generation
        continues its text (an assistant prefill); the two cannot be combined.
        """
        if add_generation_prompt is None:
            add_generation_prompt = not continue_final_message
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot be combined: the first "
                             "continues the last message, the second opens a new assistant turn after it")
        name = "tool_use" if tools and "tool_use" in self.templates else "default"
        source = self.templates.get(name)
        if source is None:
            raise ValueError("this checkpoint has no chat template")
        prepared = [_prepare_message(m) for m in messages]
        final = _tag_final_message(prepared, source) if continue_final_message else None
        # transformers always defines `documents`, and lets kwargs override special tokens
        variables = {"documents": None, **self.special_tokens, **template_kwargs}
        rendered = compile_template(source).render(
            **variables,
            messages=prepared,
            tools=list(tools) if tools is not None else None,
            add_generation_prompt=add_generation_prompt,
        )
        return rendered if final is None else _cut_at_tag(rendered, final)


# -- continuing the final message ----------------------------------------------------------

#: appended to the text being continued; where it lands in the rendering is where that text ends
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


def _tag_final_message(messages: list[dict[str, Any]], source: str) -> str:
    """Append the tag to the last message's (last) text; returns that text untagged.

    Mirrors transformers' ``continue_final_message``, so both render the same prompt.
    """
    if not messages:
        raise ValueError("continue_final_message needs a message to continue")
    if "content" not in source:
        raise ValueError("continue_final_message: this chat template never reads a message's content")
    final = messages[-1] = dict(messages[-1])
    content = final.get("content")
    if isinstance(content, str):
        final["content"] = content + _CONTINUE_TAG
        return content
    if isinstance(content, (list, tuple)):
        blocks = [dict(b) if isinstance(b, Mapping) else b for b in content]
        for block in reversed(blocks):
            if isinstance(block, dict) and "text" in block:
                text = block["text"]
                block["text"] = text + _CONTINUE_TAG
                final["content"] = blocks
                return text
    raise ValueError("continue_final_message: the final message has no text to continue")


def _cut_at_tag(rendered: str, final: str) -> str:
    """The rendering up to where the continued text ends (the tag and all after it dropped)."""
    tag = _CONTINUE_TAG.strip()
    if final.strip() not in rendered or tag not in rendered:
        raise ValueError("continue_final_message: the chat template dropped part of the final message, "
                         "so it cannot be continued")
    at = rendered.rindex(tag)
    if rendered[at:at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return rendered[:at]
    # the template trimmed the tag's trailing space, so it trims message ends: do the same
    return rendered[:at].rstrip()
