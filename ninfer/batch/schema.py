"""Reading a batch input file: JSON text -> a validated :class:`BatchInput`.

Every problem is reported under its JSON path (``requests[3].logit_bias["12"]``), all of
them in one pass. Fields the format does not know are warnings, not errors, so files
written for other runtimes still run. A ``null`` value means the field is not set.
Nothing here needs the model: token ids past the vocabulary, features this build lacks
(media, LoRA) and whether a guide compiles are decided per request by the runner.
The sampling fields are checked by the rules of :mod:`ninfer.sampling_schema`, under the
format's own names (``sampling_seed``, ``num_logprobs``, ``max_generate_length``).
"""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from ninfer.sampling_schema import MAX_LOGPROBS, Limits, Problem
from ninfer.sampling_wire import Report, SamplingWire, WireField

MAX_BIAS_ENTRIES = 1024
MAX_SEED = 2**64 - 1
DEFAULT_MAX_GENERATE_LENGTH = 256
ROLES = ("system", "user", "assistant")
MEDIA_TYPES = ("image", "audio", "video")
GUIDE_MODES = ("json_object", "json_schema", "regex", "ebnf", "structural_tag", "choice")
LOOKUP_POLICIES = ("use_cache", "bypass")
COMMIT_POLICIES = ("including_generated_tokens", "prefill_state_only")
PROPOSAL_POLICIES = ("auto", "greedy", "probabilistic")

#: the format's sampling fields (ninfer.sampling_schema has their rules): those a request
#: may set too (absent there: the top-level value), then the top-level ones, then stop
_PER_REQUEST = (
    WireField("sampling_seed", "seed", limits=Limits(0, MAX_SEED)),  # unsigned, unlike requests' seed
    WireField("logit_bias", max_items=MAX_BIAS_ENTRIES),
    WireField("num_logprobs", "logprobs", limits=Limits(0, MAX_LOGPROBS)),
)
GLOBAL_SAMPLING = SamplingWire(
    WireField("temperature"), WireField("top_p"), WireField("top_k"), *_PER_REQUEST,
    WireField("max_generate_length", "max_tokens", absent=DEFAULT_MAX_GENERATE_LENGTH),
)
REQUEST_SAMPLING = SamplingWire(*_PER_REQUEST, WireField("stop"))

_GLOBAL_KEYS = (
    "batch_size", *(f.wire for f in GLOBAL_SAMPLING), "spec_proposal_sampling", "apply_chat_template",
    "add_generation_prompt", "enable_thinking", "context_cache_lookup_policy", "context_cache_commit_policy",
    "available_lora_weights", "guided_decoding", "requests",
)
_REQUEST_KEYS = (
    "messages", *(f.wire for f in REQUEST_SAMPLING), "lora_name", "save_system_prompt_kv_cache",
    "disable_spec_decode", "guided_decoding",
)


class BatchInputError(ValueError):
    """The input cannot run; ``errors`` holds every problem as ``json.path: message``."""

    def __init__(self, errors: list[str]):
        super().__init__("\n".join(errors))
        self.errors = errors


@dataclass(frozen=True)
class BatchRequest:
    """One request with the global defaults already folded in."""

    index: int
    #: ``{"role", "content"}`` pairs; content is a string or a list of content items
    messages: list[dict[str, Any]]
    sampling_seed: Optional[int] = None
    lora_name: Optional[str] = None
    disable_spec_decode: bool = False
    logit_bias: dict[int, float] = field(default_factory=dict)
    num_logprobs: int = 0
    stop: list[str] = field(default_factory=list)
    guided_decoding: Optional[dict[str, Any]] = None
    #: JSON path of the guide in force (the request's own, or the top-level default)
    guided_decoding_path: str = "guided_decoding"
    #: ``(type, JSON path)`` of the first image/audio/video item, if any
    media_item: Optional[tuple[str, str]] = None


@dataclass(frozen=True)
class BatchInput:
    """The whole file. Sampler fields left None fall back to the profile, then the format's defaults."""

    requests: list[BatchRequest]
    batch_size: int = 1
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    max_generate_length: int = DEFAULT_MAX_GENERATE_LENGTH
    apply_chat_template: bool = True
    add_generation_prompt: bool = True
    enable_thinking: bool = False
    lookup_policy: str = "use_cache"
    commit_policy: str = "including_generated_tokens"
    spec_proposal_sampling: str = "auto"
    available_lora_weights: dict[str, str] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)


def _at(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


class _Reader:
    """Typed field access that records problems instead of raising, so all are reported."""

    def __init__(self) -> None:
        self.errors: list[str] = []
        self.warnings: list[str] = []

    def error(self, path: str, message: str) -> None:
        self.errors.append(f"{path}: {message}")

    def reporter(self, path: str) -> Report:
        """Where sampling-field problems under ``path`` go (see :mod:`ninfer.sampling_wire`)."""
        def report(param: str, problem: Problem, unsupported: bool) -> None:
            self.error(_at(path, param) + problem.where, problem.reason)
        return report

    def unknown_keys(self, obj: dict, path: str, allowed: tuple[str, ...]) -> None:
        for key in obj:
            if key not in allowed:
                close = difflib.get_close_matches(key, allowed, n=1)
                hint = f" (did you mean {close[0]}?)" if close else ""
                self.warnings.append(f"{_at(path, key)}: unknown field, ignored{hint}")

    def get(self, obj: dict, key: str, path: str, ok: Callable[[Any], bool], want: str, default: Any = None) -> Any:
        value = obj.get(key)
        if value is None:
            return default
        if not ok(value):
            self.error(_at(path, key), f"must be {want}")
            return default
        return value

    def boolean(self, obj: dict, key: str, path: str, default: bool) -> bool:
        return self.get(obj, key, path, lambda v: isinstance(v, bool), "true or false", default)

    def integer(self, obj: dict, key: str, path: str, lo: int, hi: Optional[int], default: Any = None) -> Any:
        want = f"an integer in [{lo}, {hi}]" if hi is not None else f"an integer >= {lo}"
        return self.get(obj, key, path, lambda v: _is_int(v) and lo <= v and (hi is None or v <= hi), want, default)

    def choice(self, obj: dict, key: str, path: str, allowed: tuple[str, ...]) -> str:
        want = "one of " + ", ".join(f'"{a}"' for a in allowed)
        return self.get(obj, key, path, lambda v: v in allowed, want, allowed[0])

    # -- composite fields ------------------------------------------------------------
    def guide(self, value: Any, path: str) -> Optional[dict[str, Any]]:
        if not isinstance(value, dict):
            self.error(path, "must be an object setting exactly one of " + ", ".join(GUIDE_MODES))
            return None
        for key in value:
            if key not in GUIDE_MODES:
                close = difflib.get_close_matches(key, GUIDE_MODES, n=1)
                hint = f"did you mean {close[0]}?" if close else "modes: " + ", ".join(GUIDE_MODES)
                self.error(_at(path, key), f"unknown guided decoding mode ({hint})")
        modes = [k for k in value if k in GUIDE_MODES and value[k] is not None]
        if len(modes) != 1:
            got = ", ".join(modes) or "none"
            self.error(path, f"must set exactly one of {', '.join(GUIDE_MODES)} (got {got})")
            return None
        mode = modes[0]
        if self._guide_value(mode, value[mode], _at(path, mode)):
            return {mode: value[mode]}
        return None

    def _guide_value(self, mode: str, value: Any, path: str) -> bool:
        if mode in ("regex", "ebnf"):
            if isinstance(value, str) and value:
                return True
            self.error(path, "must be a non-empty string")
            return False
        if isinstance(value, str):  # every structured mode may arrive as escaped JSON
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                self.error(path, f"is a string but not valid JSON: {e}")
                return False
        if mode == "choice":
            ok = isinstance(value, list) and bool(value) and all(isinstance(c, str) for c in value)
            want = "a non-empty array of strings"
        elif mode == "json_object":
            # the mode takes no schema; accepting one here would throw it away unseen
            ok, want = value is True, "true (it takes no schema; json_schema constrains to one)"
        else:
            ok, want = isinstance(value, dict), "a JSON object"
        if not ok:
            self.error(path, f"must be {want}")
        return ok

    def messages(self, value: Any, path: str) -> tuple[list[dict[str, Any]], Optional[tuple[str, str]]]:
        if not isinstance(value, list) or not value:
            self.error(path, "must be a non-empty array of message objects")
            return [], None
        out, media = [], None
        for i, message in enumerate(value):
            where = f"{path}[{i}]"
            if not isinstance(message, dict):
                self.error(where, "must be an object with role and content")
                continue
            self.unknown_keys(message, where, ("role", "content"))
            role = message.get("role")
            if role not in ROLES:
                self.error(_at(where, "role"), "must be one of " + ", ".join(f'"{r}"' for r in ROLES))
            content, found = self.content(message.get("content"), _at(where, "content"))
            media = media or found
            out.append({"role": role, "content": content})
        return out, media

    def content(self, value: Any, path: str) -> tuple[Any, Optional[tuple[str, str]]]:
        if isinstance(value, str):
            return value, None
        if not isinstance(value, list):
            self.error(path, "must be a string or an array of content items")
            return "", None
        media = None
        for j, item in enumerate(value):
            where = f"{path}[{j}]"
            kind = item.get("type") if isinstance(item, dict) else None
            if kind == "text":
                self.unknown_keys(item, where, ("type", "text"))
                if not isinstance(item.get("text"), str):
                    self.error(_at(where, "text"), "must be a string")
            elif kind in MEDIA_TYPES:
                self.unknown_keys(item, where, ("type", kind, "do_resize"))
                if item.get(kind) is None:
                    self.error(_at(where, kind), f"is required for a {kind} item")
                self.boolean(item, "do_resize", where, True)
                media = media or (kind, where)
            elif isinstance(item, dict):
                self.error(_at(where, "type"), "must be one of " + ", ".join(f'"{t}"' for t in ("text", *MEDIA_TYPES)))
            else:
                self.error(where, "must be a content item object")
        return value, media


#: objects whose keys are names or token ids, written ``field["key"]`` in paths
_MAPS = ("logit_bias", "available_lora_weights")


def _duplicate_key_warnings(value: Any, repeated: dict[int, tuple[dict, list[str]]], path: str = "") -> list[str]:
    """One warning per key an object of ``value`` repeats (``repeated``: id -> (the object, its keys))."""
    out: list[str] = []
    if isinstance(value, list):
        for i, item in enumerate(value):
            out += _duplicate_key_warnings(item, repeated, f"{path}[{i}]")
    elif isinstance(value, dict):
        as_map = path.rsplit(".", 1)[-1] in _MAPS

        def child(key: str) -> str:
            return f"{path}[{json.dumps(key)}]" if as_map else _at(path, key)

        obj, keys = repeated.get(id(value), (None, []))
        out += [f"{child(key)}: duplicate key; the last value is used" for key in keys if obj is value]
        for key, item in value.items():
            out += _duplicate_key_warnings(item, repeated, child(key))
    return out


def parse_batch_json(text: str) -> BatchInput:
    """Parse and validate the text of an input file; raises :class:`BatchInputError`."""

    def no_constants(name: str) -> None:
        raise ValueError(f"{name} is not valid JSON")

    # keeping each object alive keeps its id from naming a later one
    repeated: dict[int, tuple[dict, list[str]]] = {}

    def keep_last(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        obj = dict(pairs)  # the last value wins, as in Python's json and most parsers
        if len(obj) < len(pairs):
            keys = [key for key, _ in pairs]
            repeated[id(obj)] = (obj, sorted({key for key in keys if keys.count(key) > 1}, key=keys.index))
        return obj

    try:
        data = json.loads(text, parse_constant=no_constants, object_pairs_hook=keep_last)
    except ValueError as e:  # JSONDecodeError is a ValueError too
        raise BatchInputError([f"input: not valid JSON: {e}"]) from None
    return parse_batch(data, notes=_duplicate_key_warnings(data, repeated) if repeated else [])


def parse_batch(data: Any, notes: Optional[list[str]] = None) -> BatchInput:
    """Validate an already-parsed input document; raises :class:`BatchInputError`.

    ``notes``: warnings found while reading the text (repeated keys), reported first."""
    if not isinstance(data, dict):
        raise BatchInputError(["input: must be a JSON object with a requests array"])
    r = _Reader()
    r.warnings += notes or []
    r.unknown_keys(data, "", _GLOBAL_KEYS)
    loras = data.get("available_lora_weights") or {}
    if not isinstance(loras, dict):
        r.error("available_lora_weights", "must be an object mapping adapter names to file paths")
        loras = {}
    for name, path in loras.items():
        if not (isinstance(path, str) and path):
            r.error(f"available_lora_weights[{json.dumps(name)}]", "must be a non-empty file path string")
    sampling = GLOBAL_SAMPLING.read(data, report=r.reporter(""))
    guide = r.guide(data["guided_decoding"], "guided_decoding") if data.get("guided_decoding") is not None else None
    settings = dict(
        batch_size=r.integer(data, "batch_size", "", 1, None, 1),
        temperature=sampling["temperature"],
        top_p=sampling["top_p"],
        top_k=sampling["top_k"],
        max_generate_length=sampling["max_generate_length"],
        apply_chat_template=r.boolean(data, "apply_chat_template", "", True),
        add_generation_prompt=r.boolean(data, "add_generation_prompt", "", True),
        enable_thinking=r.boolean(data, "enable_thinking", "", False),
        lookup_policy=r.choice(data, "context_cache_lookup_policy", "", LOOKUP_POLICIES),
        commit_policy=r.choice(data, "context_cache_commit_policy", "", COMMIT_POLICIES),
        spec_proposal_sampling=r.choice(data, "spec_proposal_sampling", "", PROPOSAL_POLICIES),
    )
    requests = data.get("requests")
    parsed: list[BatchRequest] = []
    if requests is None:
        r.error("requests", "is required")
    elif not isinstance(requests, list) or not requests:
        r.error("requests", "must be a non-empty array of request objects")
    else:
        defaults = {"sampling_seed": sampling["sampling_seed"], "logit_bias": sampling["logit_bias"] or {},
                    "num_logprobs": sampling["num_logprobs"] or 0, "guided_decoding": guide}
        parsed = [_request(r, i, req, defaults, loras) for i, req in enumerate(requests)]
    if r.errors:
        raise BatchInputError(r.errors)
    return BatchInput(requests=parsed, available_lora_weights=dict(loras), warnings=r.warnings, **settings)


def _request(r: _Reader, i: int, req: Any, defaults: dict[str, Any], loras: dict) -> BatchRequest:
    path = f"requests[{i}]"
    if not isinstance(req, dict):
        r.error(path, "must be an object with a messages array")
        return BatchRequest(index=i, messages=[])  # never run: the error stops the batch
    r.unknown_keys(req, path, _REQUEST_KEYS)
    if "messages" not in req:
        r.error(_at(path, "messages"), "is required")
    messages, media = r.messages(req.get("messages"), _at(path, "messages")) if "messages" in req else ([], None)
    lora = r.get(req, "lora_name", path, lambda v: isinstance(v, str), "a string")
    if lora is not None and lora not in loras:
        known = ", ".join(map(json.dumps, loras)) or "none are declared"
        r.error(_at(path, "lora_name"), f"{json.dumps(lora)} is not in available_lora_weights ({known})")
    r.boolean(req, "save_system_prompt_kv_cache", path, False)  # legacy; prefix reuse covers it
    own = REQUEST_SAMPLING.read(req, report=r.reporter(path))

    def inherit(key: str) -> Any:
        return defaults[key] if own[key] is None else own[key]

    guide = req.get("guided_decoding")
    return BatchRequest(
        index=i,
        messages=messages,
        lora_name=lora,
        disable_spec_decode=r.boolean(req, "disable_spec_decode", path, False),
        sampling_seed=inherit("sampling_seed"),
        logit_bias=inherit("logit_bias"),
        num_logprobs=inherit("num_logprobs"),
        stop=own["stop"] or [],
        guided_decoding=defaults["guided_decoding"] if guide is None else r.guide(guide, _at(path, "guided_decoding")),
        guided_decoding_path="guided_decoding" if guide is None else _at(path, "guided_decoding"),
        media_item=media,
    )
