"""Startup profiles: schema vs. the spec's option table, validation, overrides, resolution."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

import attrs
import pytest
import yaml

from ninfer.capabilities import Protocol, SpeculativeBackend
from ninfer.cli.serve import build_parser
from ninfer.hookspecs import hookimpl
from ninfer.plugins import PluginRegistry
from ninfer.profile import Profile, ProfileError, check_selections, default_profile_path, load_profile, resolve, to_yaml
from _shared import shared_path
from ninfer.profile.checks import Bool
from ninfer.profile.flags import overrides_from_args
from ninfer.profile.schema import SECTIONS, options

SPEC = shared_path("spec", "serving.md")
CONFIGS = Path(__file__).resolve().parents[1] / "configs"

Expected = Any | Callable[[Profile], Any]
C = lambda p: p.engine.max_concurrency  # noqa: E731 - shorthand for the derived defaults below
# flag -> (how the spec's Default column ends, the resolved default as a value or a function of the profile)
SPEC_DEFAULTS: dict[str, tuple[str, Expected]] = {
    "--host": ("127.0.0.1", "127.0.0.1"),
    "--port": ("8080", 8080),
    "--api-key": ("unset", None),
    "--model-id": ("identity.model_id", None),
    "--max-context": ("8192", 8192),
    "--kv-capacity": ("--max-context 8192", lambda p: p.engine.max_context),
    "--max-concurrency": (" 1", 1),
    "--max-pending-requests": ("16", 16),
    "--pending-timeout-ms": ("30000", 30000),
    "--prefill-chunk": ("1024", 1024),
    "--log-stats-interval-ms": ("5000", 5000),
    "--log-level": ("info", "info"),
    "--device": ("0", 0),
    "--context-cost-presets": ("compiled defaults", None),
    "--max-request-mib": ("384", 384),
    "--media-cache-mib": ("1024", 1024),
    "--media-live-mib": ("2048", 2048),
    "--media-preprocess-threads": (" 0", 0),
    "--request-log-jsonl": ("disabled", None),
    "--response-store-max-records": ("1024", 1024),
    "--response-store-max-mib": ("256", 256),
    "--kv-dtype": ("bf16", "bf16"),
    "--spec": ("off", None),
    "--draft-tokens": ("unset", None),
    "--lm-head-draft": ("off", False),
    "--default-max-tokens": ("8192", 8192),
    "--default-thinking-budget": ("unset", None),
    "--vision": ("off", False),
    "--no-cuda-graph": (" on", True),
    "--no-prefix-reuse": ("prefix reuse on", True),
    "--device-state-slots": ("max-concurrency", C),
    "--host-state-slots": ("8", 8),
    "--host-kv-mib": ("8192", 8192),
    "--max-private-continuations": ("2 * max-concurrency", lambda p: 2 * C(p)),
    "--max-shared-prefixes": ("max(max-concurrency, 4)", lambda p: max(C(p), 4)),
    "--max-long-anchors-per-continuation": ("2", 2),
    "--no-thinking": ("thinking on", True),
    "--preserve-thinking": ("off", False),
    "--tolerant-tool-calls": ("off", False),
    "--cors": ("off", False),
    "--temperature": ("unset", None),
    "--top-p": ("unset", None),
    "--top-k": ("unset", None),
    "--min-p": ("unset", None),
    "--presence-penalty": ("unset", None),
    "--frequency-penalty": ("unset", None),
    "--seed": ("fresh random seed per request", None),
    "--greedy": ("off", False),
}


def spec_option_rows() -> dict[str, str]:
    """flag -> its whole row in the spec's "Server options" table."""
    lines = SPEC.read_text(encoding="utf-8").splitlines()
    start = lines.index("Server options")
    rows = {}
    for line in lines[start + 1:]:
        if line.startswith("--"):
            rows[line.split()[0]] = line
        elif rows and line.strip():
            break
    return rows


BOOL_FLAGS = {f"--{no}{o.flag or key.rsplit('.', 1)[-1].replace('_', '-')}"
              for key, _, o in options() if isinstance(o.parse, Bool) for no in ("", "no-")}


def key_of(flag: str) -> str:
    """The profile key our parser stores a spec flag under (one key per flag)."""
    args = [flag] if flag in BOOL_FLAGS else [flag, "1"]
    overrides = overrides_from_args(build_parser().parse_args(args))
    assert len(overrides) == 1, (flag, overrides)
    return next(iter(overrides))


def value_at(profile: Profile, key: str) -> Any:
    obj: Any = profile
    for part in key.split("."):
        obj = getattr(obj, part)
    return obj


def test_spec_table_is_what_this_test_expects():
    rows = spec_option_rows()
    assert len(rows) > 40
    assert set(rows) == set(SPEC_DEFAULTS), "the spec's option table changed: update SPEC_DEFAULTS and the schema"
    for flag, (default_text, _) in SPEC_DEFAULTS.items():
        assert rows[flag].endswith(default_text), (flag, rows[flag])


@pytest.mark.parametrize("overrides", [{}, {"max_concurrency": 6, "max_context": 1000}], ids=["defaults", "c6"])
def test_every_spec_flag_is_accepted_with_the_spec_default(overrides):
    profile = resolve(load_profile(model="m", overrides=overrides))
    for flag, (_, expected) in SPEC_DEFAULTS.items():
        key = key_of(flag)
        want = expected(profile) if callable(expected) else expected
        if key.removeprefix("engine.") in overrides:
            want = overrides[key.removeprefix("engine.")]
        assert value_at(profile, key) == want, flag


def test_each_option_has_one_distinct_flag_and_help_shows_defaults():
    help_text = build_parser().format_help()
    flagged = [(key, o) for key, _, o in options() if key != "model"]
    for key, o in flagged:
        flag = "--" + (o.flag or key.rsplit(".", 1)[-1].replace("_", "-"))
        assert f" {flag} " in help_text or f" {flag}," in help_text, flag
        assert key_of(flag) == key
    assert help_text.count("(default:") == len(flagged)
    for flag, key in [("--dtype", "dtype"), ("--block-size", "engine.block_size"), ("--plugins", "plugins.allow"),
                      ("--reasoning-parser", "reasoning.parser"), ("--tool-parser", "tools.parser"),
                      ("--protocols", "server.protocols"), ("--log-level", "logging.level")]:
        assert key_of(flag) == key


def test_override_precedence(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text("model: from-file\nengine:\n  max_context: 4096\n  kv_dtype: fp8\nspeculative:\n"
                    "  backend: mtp\n  draft_tokens: 3\n")
    p = load_profile(str(path))
    assert (p.model, p.engine.max_context, p.speculative.backend) == ("from-file", 4096, "mtp")
    p = load_profile(str(path), model="from-arg",
                     overrides={"max_context": 2048, "engine.kv_dtype": "int8", "no_prefix_reuse": True,
                                "spec": None, "draft_tokens": None, "plugins": ["a", "b"]})
    assert p.model == "from-arg"
    assert (p.engine.max_context, p.engine.kv_dtype, p.engine.prefix_reuse) == (2048, "int8", False)
    assert p.speculative.backend is None and p.plugins.allow == ["a", "b"]
    assert resolve(p).engine.kv_capacity == 2048  # follows the overridden context
    assert load_profile(model="m", overrides={"model": "x"}).model == "x"


def errors_of(**kw: Any) -> list[str]:
    with pytest.raises(ProfileError) as info:
        load_profile(**kw)
    return info.value.errors


def test_invalid_values_are_all_reported_with_key_path_and_allowed_values():
    errors = errors_of(model="m", overrides={"max_concurrency": 0, "top_k": 21, "port": 70000, "top_p": 0,
                                             "temperature": float("nan"), "block_size": 48, "log_level": "loud",
                                             "kv_capacity": "most", "device": "gpu", "default_thinking_budget": 0})
    expect = {"engine.max_concurrency": "1..8", "sampling.top_k": "0..20", "server.port": "1..65535",
              "sampling.top_p": "(0, 1]", "sampling.temperature": "finite", "engine.block_size": "power of two",
              "logging.level": "trace, debug", "engine.kv_capacity": "auto", "engine.device": "cpu or cuda",
              "reasoning.default_thinking_budget": ">= 1"}
    assert len(errors) == len(expect)
    for key, allowed in expect.items():
        assert any(e.startswith(f"{key}: ") and allowed in e for e in errors), (key, errors)


@pytest.mark.parametrize("backend,draft,ok", [("mtp", 5, True), ("mtp", 6, False), ("dflash", 15, True),
                                              ("dflash2", 16, False), ("eagle", 9, True), (None, 3, False),
                                              ("mtp", None, False)])
def test_draft_tokens_follow_the_backend_ranges(backend, draft, ok):
    kw = {"model": "m", "overrides": {"spec": backend, "draft_tokens": draft}}
    if ok:
        assert load_profile(**kw).speculative.draft_tokens == draft
    else:
        assert any(e.startswith("speculative.draft_tokens: ") for e in errors_of(**kw))


def test_no_prefix_reuse_rejects_explicit_cache_capacities_even_zero():
    cache_flags = ["device_state_slots", "host_state_slots", "host_kv_mib", "max_private_continuations",
                   "max_shared_prefixes", "max_long_anchors_per_continuation"]
    errors = errors_of(model="m", overrides={"no_prefix_reuse": True, **{f: 0 for f in cache_flags}})
    assert sorted(e.split(":")[0] for e in errors) == sorted(f"cache.{f}" for f in cache_flags)
    resolved = resolve(load_profile(model="m", overrides={"no_prefix_reuse": True}))
    assert attrs.astuple(resolved.cache) == (None,) * len(cache_flags)
    assert load_profile(model="m", overrides={"host_kv_mib": 0}).cache.host_kv_mib == 0


def test_unknown_keys_and_wrong_types(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text("model: m\nbogus: 1\nengine:\n  max_contxt: 10\n  max_concurrency: 2.5\n  cuda_graph: 'yes'\n"
                    "server:\n  port: '8080'\n  protocols: openai_chat\nsampling: 3\n")
    errors = errors_of(path=str(path))
    assert any(e.startswith("bogus: unknown key") and "allowed: model" in e for e in errors)
    assert "engine.max_contxt: unknown key (did you mean max_context?)" in errors
    for key in ["engine.max_concurrency", "engine.cuda_graph", "server.port", "server.protocols", "sampling"]:
        assert any(e.startswith(f"{key}: expected") for e in errors), key
    assert any(e.startswith("speed: unknown option") for e in errors_of(model="m", overrides={"speed": 1}))


def test_a_key_in_the_wrong_section_points_to_where_it_belongs(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text("model: m\nserver:\n  max_context: 100\nmax_concurrency: 2\nengine:\n  model: x\n")
    errors = errors_of(path=str(path))
    assert "server.max_context: unknown key (did you mean engine.max_context?)" in errors
    assert "max_concurrency: unknown key (did you mean engine.max_concurrency?)" in errors
    assert "engine.model: unknown key (did you mean the top-level model?)" in errors


def test_unreadable_profiles(tmp_path):
    assert "cannot read profile" in errors_of(path=str(tmp_path / "missing.yaml"))[0]
    bad = tmp_path / "bad.yaml"
    bad.write_text("engine: [1,\n")
    assert "not valid YAML" in errors_of(path=str(bad))[0]
    bad.write_text("- a\n- b\n")
    assert "expected a mapping" in errors_of(path=str(bad))[0]
    assert errors_of(model=None, overrides={"model": None})[0].startswith("model: required")


def test_env_references_and_redaction(tmp_path, monkeypatch):
    path = tmp_path / "p.yaml"
    path.write_text("model: ${CKPT_ROOT}/qwen\nserver:\n  api_key: ${NINFER_TEST_KEY}\n")
    monkeypatch.setenv("CKPT_ROOT", "/data")
    monkeypatch.setenv("NINFER_TEST_KEY", "s3cret")
    p = load_profile(str(path))
    assert (p.model, p.server.api_key) == ("/data/qwen", "s3cret")
    assert "s3cret" not in to_yaml(p) and "api_key: <redacted>" in to_yaml(p)
    assert "api_key: s3cret" in to_yaml(p, redact=False)
    # A --check printout fed back must not silently use the placeholder as the key.
    assert any(e.startswith("server.api_key: ") for e in errors_of(model="m", overrides={"api_key": "<redacted>"}))
    monkeypatch.delenv("NINFER_TEST_KEY")
    assert errors_of(path=str(path)) == ["server.api_key: environment variable NINFER_TEST_KEY is not set"]


def test_resolve_fills_derived_defaults_and_keeps_given_values():
    p = resolve(load_profile(model="m", overrides={"max_concurrency": 3, "host_state_slots": 0}))
    c = p.cache
    assert (c.device_state_slots, c.max_private_continuations, c.max_shared_prefixes) == (3, 6, 4)
    assert (c.host_state_slots, c.host_kv_mib, c.max_long_anchors_per_continuation) == (0, 8192, 2)
    assert resolve(p) == p
    assert resolve(load_profile(model="m", overrides={"kv_capacity": "auto"})).engine.kv_capacity == "auto"


@pytest.mark.parametrize("overrides", [{"api_key": None, "max_concurrency": 5}, {"no_prefix_reuse": True}])
def test_printed_profile_loads_back_to_the_same_profile(tmp_path, overrides):
    p = resolve(load_profile(model="m", overrides=overrides))
    text = to_yaml(p)
    data = yaml.safe_load(text)
    assert list(data) == ["model", "model_id", "dtype", *SECTIONS]
    for section, cls in SECTIONS.items():
        assert list(data[section]) == [f.name for f in attrs.fields(cls)]
    path = tmp_path / "printed.yaml"
    path.write_text(text)
    assert resolve(load_profile(str(path))) == p


def test_default_and_shipped_profiles():
    assert Path(default_profile_path()) == CONFIGS / "demo.yaml"
    demo = load_profile()
    assert (demo.model, demo.dtype, demo.engine.max_concurrency) == ("tiny:qwen3", "auto", 4)
    assert demo.engine.max_context <= 8192
    big = resolve(load_profile(str(CONFIGS / "qwen27b-fp8-mtp.yaml")))
    e, c, s = big.engine, big.cache, big.speculative
    assert (e.max_context, e.kv_capacity, e.max_concurrency, e.kv_dtype) == (240000, 240000, 2, "fp8")
    assert (s.backend, s.draft_tokens, s.lm_head_draft, big.reasoning.preserve_thinking) == ("mtp", 3, True, True)
    assert (c.device_state_slots, c.host_state_slots, c.host_kv_mib) == (2, 8, 8192)


class _Plugins:
    @hookimpl
    def register_kv_dtypes(self, register):
        for name in ("bf16", "int8"):
            register(SimpleNamespace(name=name, description=""))

    @hookimpl
    def register_speculative_backends(self, register):
        register(SpeculativeBackend(name="eagle", draft_tokens=(1, 8)))

    @hookimpl
    def register_protocols(self, register):
        register(Protocol(name="openai_chat"))


def test_check_selections_against_a_registry():
    registry = PluginRegistry()
    registry.register_plugin(_Plugins(), name="test_plugins")
    assert check_selections(load_profile(model="m"), registry) == []
    bad = load_profile(model="m", overrides={"kv_dtype": "fp8", "spec": "eagle", "draft_tokens": 9,
                                             "protocols": ["openai_chat", "anthropic_messages"],
                                             "tool_parser": "hermes_json"})
    errors = check_selections(bad, registry)
    assert errors[0] == "engine.kv_dtype: no plugin provides kv_dtype 'fp8' (available: bf16, int8)"
    assert "speculative.draft_tokens: the eagle backend accepts 1..8, got 9" in errors
    assert any(e.startswith("tools.parser: ") for e in errors)
    assert any(e.startswith("server.protocols: ") and "anthropic_messages" in e for e in errors)
    assert len(errors) == 4


def test_flag_text_converts_to_the_option_type_and_null_clears():
    args = build_parser().parse_args(["--top-p", "0.5", "--device", "cpu", "--plugins", "a, b", "--spec", "null",
                                      "--max-context", "abc", "--no-cuda-graph", "--seed", "-7"])
    assert overrides_from_args(args) == {
        "sampling.top_p": 0.5, "engine.device": "cpu", "plugins.allow": ["a", "b"], "speculative.backend": None,
        "engine.max_context": "abc", "engine.cuda_graph": False, "sampling.seed": -7,
    }
    assert errors_of(model="m", overrides=overrides_from_args(args)) == [
        "engine.max_context: expected an integer >= 1, got 'abc'"]


@pytest.mark.parametrize("given,canonical", [
    ("auto", "auto"), ("Auto", "auto"), ("bf16", "bf16"), ("bfloat16", "bf16"), ("BF16", "bf16"),
    ("fp16", "fp16"), ("float16", "fp16"), ("half", "fp16"), ("fp32", "fp32"), ("float32", "fp32"),
    ("float", "fp32"), ("FP32", "fp32"),
])
def test_dtype_accepts_vllm_names_and_keeps_ours(tmp_path, given, canonical):
    flag = overrides_from_args(build_parser().parse_args(["--dtype", given]))
    assert load_profile(model="m", overrides=flag).dtype == canonical
    assert load_profile(model="m", overrides={"dtype": given}).dtype == canonical  # as LLM(..., dtype=) passes it
    path = tmp_path / "p.yaml"
    path.write_text(f"model: m\ndtype: {given}\n")
    assert yaml.safe_load(to_yaml(load_profile(str(path))))["dtype"] == canonical


def test_unknown_dtype_names_ours_and_the_other_spellings():
    (error,) = errors_of(model="m", overrides={"dtype": "int4"})
    assert error.startswith("dtype: expected one of auto, bf16, fp16, fp32 (or bfloat16, float16, half")
    assert errors_of(model="m", overrides={"dtype": 16})[0].startswith("dtype: expected")


def test_engine_dtype_resolution_takes_either_spelling(tiny_qwen3):
    import torch

    from ninfer import LLM
    from ninfer.engine.builder import resolve_dtype

    cpu = torch.device("cpu")
    assert resolve_dtype("bfloat16", cpu) is resolve_dtype("bf16", cpu) is torch.bfloat16
    assert resolve_dtype("half", cpu) is torch.float16 and resolve_dtype("auto", cpu) is torch.float32
    llm = LLM(str(tiny_qwen3), dtype="float32", device="cpu", max_context=64, kv_capacity=64)
    assert (llm.profile.dtype, llm.loaded.dtype) == ("fp32", torch.float32)
