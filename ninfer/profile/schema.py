"""The startup-profile schema: one attrs class per YAML section.

Every field carries an :class:`Opt` in its metadata: the parser that validates it, its
help text and its CLI flag. ``ninfer-serve``'s flags are generated from these, so the
YAML keys and the command line cannot drift apart. Capacities whose default depends
on other options default to ``None`` here ("not given") and are filled in by
:func:`ninfer.profile.resolve.resolve`.
"""

from __future__ import annotations

from typing import Any, Iterator

import attrs

from ninfer.profile.checks import Bool, Choice, Float, Int, Names, Optional, Parser, Str
from ninfer.sampling_schema import FIELDS, INT, SamplingField

METADATA_KEY = "ninfer"
LOG_LEVELS = ("trace", "debug", "info", "warning", "error", "critical", "off")
DTYPES = ("auto", "bf16", "fp16", "fp32")
#: the dtype names vLLM and PyTorch users type, and which of ours each one means
DTYPE_ALIASES = (("bfloat16", "bf16"), ("float16", "fp16"), ("half", "fp16"), ("float32", "fp32"),
                 ("float", "fp32"))
DTYPE = Choice(DTYPES, DTYPE_ALIASES)
#: draft-token ranges the serving contract fixes for the backends it names; other
#: backends are checked against their plugin's declared range at startup
SPEC_DRAFT_RANGES: dict[str, tuple[int, int]] = {"mtp": (1, 5), "dflash": (1, 15), "dflash2": (1, 15)}
#: ``guided.backend`` value that turns guided decoding off
GUIDED_OFF = "none"


@attrs.frozen
class Opt:
    """How one profile key is validated and exposed on the command line."""

    parse: Parser
    help: str
    #: flag name without ``--``; None derives it from the key, "" means no flag
    flag: str | None = None
    metavar: str | None = None
    #: help wording for a default that is not a literal (e.g. derived from another key)
    default_text: str | None = None
    #: a list flag that also takes space-separated values (vLLM's ``--lora-modules a=/p b=/q``)
    spaced: bool = False


def opt(default: Any, parse: Parser, help: str, **kw: Any) -> Any:
    return attrs.field(default=default, metadata={METADATA_KEY: Opt(parse, help, **kw)})


_NAT = Int(lo=0)
_POS = Int(lo=1)


@attrs.frozen
class Server:
    host: str = opt("127.0.0.1", Str(), "listen address", metavar="H")
    port: int = opt(8080, Int(1, 65535), "listen port", metavar="N")
    api_key: str | None = opt(None, Optional(Str()), "require this bearer / x-api-key value on API calls",
                              metavar="KEY", default_text="unset, no authentication")
    cors: bool = opt(False, Bool(), "send permissive browser CORS headers")
    max_request_mib: int = opt(384, _POS, "largest request body accepted, in MiB (checked before parsing)", metavar="N")
    max_pending_requests: int = opt(16, _NAT, "requests allowed to wait behind the active ones", metavar="N")
    pending_timeout_ms: int = opt(30000, _POS, "longest wait for preparation plus admission, in ms", metavar="N")
    # Slow clients and shutdown (ninfer.server.connections, ninfer.server.run); not in the spec's table.
    drain_timeout_ms: int = opt(30000, _NAT, "on SIGTERM, how long running requests may still finish before "
                                "they are ended with an error, in ms", metavar="N")
    header_timeout_ms: int = opt(10000, _POS, "time a client has to send a request's headers, from connecting "
                                 "or from the previous response, in ms", metavar="N")
    body_timeout_ms: int = opt(10000, _POS, "time a request body may take beyond what --body-min-rate "
                               "allows, in ms", metavar="N")
    body_min_rate: int = opt(1024, _NAT, "body bytes per second that extend the body deadline by a second "
                             "(0: the body must arrive within --body-timeout-ms)", metavar="N")
    keep_alive_timeout_ms: int = opt(5000, _POS, "idle time after which a kept-alive connection closes, in ms",
                                     metavar="N")
    max_connections: int = opt(1024, _POS, "open connections; a new one past it closes the longest-idle one, "
                               "or is refused when all are busy", metavar="N")
    response_store_max_records: int = opt(1024, _POS, "Responses objects kept for later retrieval", metavar="N")
    response_store_max_mib: int = opt(256, _POS, "memory budget of stored Responses, in MiB", metavar="N")
    protocols: list[str] | None = opt(None, Optional(Names()), "protocol adapters to serve (comma-separated)",
                                      metavar="NAME,...", default_text="every installed protocol")
    lora_modules: list[str] | None = opt(None, Optional(Names()), "PEFT LoRA adapters to serve, NAME=PATH "
                                         "(space- or comma-separated); a request's model picks one by NAME",
                                         metavar="NAME=PATH", default_text="none", spaced=True)


@attrs.frozen
class Engine:
    device: int | str = opt(0, Int(lo=0, words=("cpu", "cuda")), "CUDA device index, cpu or cuda; CPU is used "
                            "when CUDA is absent", metavar="N|cpu|cuda")
    max_context: int = opt(8192, _POS, "longest sequence (prompt plus output) in tokens", metavar="N")
    kv_capacity: int | str | None = opt(None, Optional(Int(lo=1, words=("auto",))),
                                        "tokens in the shared KV pool; auto sizes it from free device memory",
                                        metavar="N|auto", default_text="follows --max-context")
    max_concurrency: int = opt(1, Int(1, 8), "requests decoded together", metavar="N")
    prefill_chunk: int = opt(1024, _POS, "prompt tokens computed per prefill step", metavar="N")
    kv_dtype: str = opt("bf16", Str(), "KV-cache format, a kv_dtype plugin (built in: bf16, int8, fp8, nvfp4, k8v4)",
                        metavar="NAME")
    cuda_graph: bool = opt(True, Bool(), "replay decode steps from CUDA graphs")
    decode_ahead: bool = opt(True, Bool(), "on CUDA, queue each decode step before the previous one's tokens "
                             "reach the host")
    prefix_reuse: bool = opt(True, Bool(), "reuse cached prompt prefixes; off starts every request from scratch")
    default_max_tokens: int = opt(8192, _POS, "output limit for requests that set none", metavar="N")
    context_cost_presets: str | None = opt(None, Optional(Str()), "YAML or JSON file of context-cost coefficients "
                                           "(prefill cost per token, host transfer GB/s; docs/context-cache.md)",
                                           metavar="FILE", default_text="generic defaults")
    block_size: int = opt(16, Int(1, 256, pow2=True), "KV page size in tokens", metavar="N")


@attrs.frozen
class Cache:
    """Context-cache capacities; all None unless given (see module docstring)."""

    device_state_slots: int | None = opt(None, Optional(_NAT), "device checkpoint slots beyond one per active "
                                         "request", metavar="N", default_text="--max-concurrency")
    host_state_slots: int | None = opt(None, Optional(_NAT), "pinned host checkpoint slots", metavar="N",
                                       default_text="8")
    host_kv_mib: int | None = opt(None, Optional(_NAT), "pinned host memory for retained KV pages, in MiB",
                                  metavar="N", default_text="8192")
    max_private_continuations: int | None = opt(None, Optional(_NAT), "conversations whose last turn the context "
                                                "cache keeps as a private continuation", metavar="N",
                                                default_text="2 x --max-concurrency")
    max_shared_prefixes: int | None = opt(None, Optional(_NAT), "client-marked shared stable prefixes kept, "
                                          "engine wide", metavar="N", default_text="max(--max-concurrency, 4)")
    max_long_anchors_per_continuation: int | None = opt(None, Optional(_NAT), "earlier turn closures kept inside "
                                                        "each private continuation", metavar="N", default_text="2")


@attrs.frozen
class Speculative:
    backend: str | None = opt(None, Optional(Str()), "speculative decoder, a speculative_backend plugin "
                              "(built in: mtp, ngram)", flag="spec", metavar="NAME", default_text="off")
    draft_tokens: int | None = opt(None, Optional(_POS), "tokens drafted per round (mtp 1..5, ngram "
                                   "1..15; a plugin declares its own range); needs --spec", metavar="N", default_text="unset")
    lm_head_draft: bool = opt(False, Bool(), "draft over a frequency-ranked shortlist of the vocabulary "
                              "(lm_head_shortlist.json beside the checkpoint); verification keeps the full head")
    lm_head_draft_size: int = opt(32768, _POS, "vocabulary entries the LM-head draft scores, most frequent first",
                                  metavar="N")


def _sampling_override(field: SamplingField) -> Any:
    """The profile option of a request field that a process flag may override (None: the preset)."""
    limits = field.limits.narrowed(field.flag.limits)
    parse = Int(limits.lo, limits.hi) if field.kind == INT else Float(limits.lo, limits.hi, limits.lo_open)
    return opt(None, Optional(parse), field.flag.help, metavar="N" if field.kind == INT else "F",
               default_text=field.flag.unset)


#: process-wide overrides of the model family's sampling presets: one option per field
#: :mod:`ninfer.sampling_schema` gives a process flag, plus ``greedy``
Sampling = attrs.make_class("Sampling", {
    **{field.name: _sampling_override(field) for field in FIELDS if field.flag is not None},
    "greedy": opt(False, Bool(), "always pick the most likely token"),
}, frozen=True)


@attrs.frozen
class Reasoning:
    thinking: bool = opt(True, Bool(), "think unless a request turns it off")
    preserve_thinking: bool = opt(False, Bool(), "keep earlier turns' reasoning in later prompts by default")
    default_thinking_budget: int | None = opt(None, Optional(_POS), "cap on reasoning tokens of thinking "
                                              "requests", metavar="N", default_text="unset")
    parser: str | None = opt(None, Optional(Str()), "reasoning_parser plugin", flag="reasoning-parser",
                             metavar="NAME", default_text="the model family's choice")


@attrs.frozen
class Tools:
    tolerant_tool_calls: bool = opt(False, Bool(), "recover complete tool calls wrapped in malformed text")
    parser: str | None = opt(None, Optional(Str()), "tool_parser plugin", flag="tool-parser", metavar="NAME",
                             default_text="the model family's choice")


@attrs.frozen
class Guided:
    backend: str | None = opt(None, Optional(Str()), "guided-decoding backend, a guided_decoding plugin; none "
                              "turns guided decoding off", flag="guided-backend", metavar="NAME|none",
                              default_text="llguidance when installed")


@attrs.frozen
class Media:
    vision: bool = opt(False, Bool(), "accept image and video input (not in this build "
                       "yet: refused)")
    media_cache_mib: int = opt(1024, _NAT, "prepared media kept for reuse, in MiB (only the "
                               "default is accepted until media input exists)", metavar="N")
    media_live_mib: int = opt(2048, _POS, "all prepared media alive at once, in MiB (only the "
                              "default is accepted until media input exists)", metavar="N")
    media_preprocess_threads: int = opt(0, _NAT, "media preparation workers (only the default, 0, is "
                                        "accepted until media input exists)", metavar="N")


@attrs.frozen
class Logging:
    level: str = opt("info", Str(LOG_LEVELS), "stderr verbosity", flag="log-level", metavar="|".join(LOG_LEVELS))
    stats_interval_ms: int = opt(5000, _NAT, "throughput report interval in ms; 0 turns it off",
                                 flag="log-stats-interval-ms", metavar="N")
    request_log_jsonl: str | None = opt(None, Optional(Str()), "append machine-readable request records to "
                                        "FILE", metavar="FILE", default_text="off")


@attrs.frozen
class Plugins:
    allow: list[str] | None = opt(None, Optional(Names()), "load only these plugins (comma-separated "
                                  "entry-point names; NINFER_PLUGINS narrows further)", flag="plugins",
                                  metavar="NAME,...", default_text="every installed plugin")


@attrs.frozen
class Profile:
    """A complete server configuration. Top-level keys first, then one key per section."""

    model: str | None = opt(None, Optional(Str()), "checkpoint directory, tiny:FAMILY, or random:SHAPE", flag="")
    model_id: str | None = opt(None, Optional(Str()), "public model name clients must send",
                               metavar="ID", default_text="the checkpoint's own id")
    dtype: str = opt("auto", DTYPE, "compute dtype; auto is bf16 on CUDA and fp32 on CPU (vLLM's names, "
                     "such as bfloat16 or half, work too)", metavar="|".join(DTYPES))
    server: Server = attrs.field(factory=Server)
    engine: Engine = attrs.field(factory=Engine)
    cache: Cache = attrs.field(factory=Cache)
    speculative: Speculative = attrs.field(factory=Speculative)
    sampling: Sampling = attrs.field(factory=Sampling)
    reasoning: Reasoning = attrs.field(factory=Reasoning)
    tools: Tools = attrs.field(factory=Tools)
    guided: Guided = attrs.field(factory=Guided)
    media: Media = attrs.field(factory=Media)
    logging: Logging = attrs.field(factory=Logging)
    plugins: Plugins = attrs.field(factory=Plugins)


attrs.resolve_types(Profile)  # turn the string annotations into classes for the lookup below
#: section name -> its class, in profile order
SECTIONS: dict[str, type] = {f.name: f.type for f in attrs.fields(Profile) if attrs.has(f.type)}


def options() -> Iterator[tuple[str, attrs.Attribute, Opt]]:
    """Every option as ``(key path, attribute, Opt)``, top-level keys first."""
    for f in attrs.fields(Profile):
        if METADATA_KEY in f.metadata:
            yield f.name, f, f.metadata[METADATA_KEY]
    for section, cls in SECTIONS.items():
        for f in attrs.fields(cls):
            yield f"{section}.{f.name}", f, f.metadata[METADATA_KEY]


def canonical_dtype(name: str) -> str:
    """``name`` in our spelling (bfloat16 -> bf16); raises ``ValueError`` for an unknown dtype."""
    return DTYPE(name)


def flag_name(key: str, o: Opt) -> str | None:
    """The ``--flag`` (without dashes) of an option, or None when it has none."""
    if o.flag == "":
        return None
    return o.flag or key.rsplit(".", 1)[-1].replace("_", "-")
