"""``ninfer-serve``: exit codes, --check / --list-plugins output, startup, and log lines."""

from __future__ import annotations

import os
import pty
import re
import subprocess
import sys
import types
from pathlib import Path

import attrs
import pytest
import yaml
from loguru import logger

from ninfer.cli.serve import main
from ninfer.hookspecs import hookimpl
from ninfer.plugins import KINDS, PluginRegistry
from ninfer.profile import Profile
from ninfer.profile.schema import SECTIONS

SERVE = Path(sys.executable).with_name("ninfer-serve")
CONFIGS = Path(__file__).resolve().parents[1] / "configs"
# Only the plugins a check of the demo profile needs (kv_native provides its kv_dtype, qwen3
# the family tiny:qwen3 names), so these runs do not depend on other plugins.
LIGHT = {"NINFER_PLUGINS": "qwen3,qwen3_reasoning,kv_native"}
LOG_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3} INFO server ready$")


def serve(*args: str, env: dict[str, str | None] | None = None) -> subprocess.CompletedProcess:
    """Run ninfer-serve; an ``env`` value of None removes that variable."""
    full_env = {k: v for k, v in {**os.environ, **LIGHT, **(env or {})}.items() if v is not None}
    return subprocess.run([str(SERVE), *args], capture_output=True, text=True, env=full_env, timeout=120)


@pytest.mark.parametrize("args,key,allowed", [
    (["--max-concurrency", "0"], "engine.max_concurrency", "1..8"),
    (["--top-k", "21"], "sampling.top_k", "0..20"),
    (["--spec", "mtp", "--draft-tokens", "6"], "speculative.draft_tokens", "1..5"),
    (["--draft-tokens", "3"], "speculative.draft_tokens", "speculative.backend"),
    (["--no-prefix-reuse", "--device-state-slots", "0"], "cache.device_state_slots", "prefix_reuse"),
])
def test_invalid_flags_exit_2_naming_the_key(args, key, allowed):
    result = serve("tiny:qwen3", *args)
    assert result.returncode == 2
    line = next(l for l in result.stderr.splitlines() if key in l)
    assert allowed in line and result.stdout == ""


def test_all_errors_are_reported_at_once(tmp_path):
    profile = tmp_path / "p.yaml"
    profile.write_text("engine:\n  max_concurrency: 9\n  unknown_knob: 1\n")
    result = serve("--profile", str(profile), "--top-k", "21", "--check")
    assert result.returncode == 2
    for key in ["engine.max_concurrency", "engine.unknown_knob", "sampling.top_k", "model: required"]:
        assert key in result.stderr


def test_check_prints_every_key_and_flags_beat_the_profile(tmp_path):
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text("{}")  # read only for its weight format
    profile = tmp_path / "p.yaml"
    profile.write_text(f"model: {tmp_path / 'ckpt'}\nengine:\n  max_context: 4096\n  max_concurrency: 2\n")
    result = serve("--profile", str(profile), "--max-context", "2048", "--no-thinking", "--check")
    assert result.returncode == 0, result.stderr
    data = yaml.safe_load(result.stdout)
    assert set(data) == {"model", "model_id", "dtype", *SECTIONS}
    for section, cls in SECTIONS.items():
        assert set(data[section]) == {f.name for f in attrs.fields(cls)}
    assert data["model"] == str(tmp_path / "ckpt")
    assert (data["engine"]["max_context"], data["engine"]["kv_capacity"]) == (2048, 2048)
    assert (data["engine"]["max_concurrency"], data["cache"]["max_private_continuations"]) == (2, 4)
    assert data["reasoning"]["thinking"] is False


def test_shipped_configs_pass_check_where_their_plugins_are_installed():
    demo = serve("--profile", str(CONFIGS / "demo.yaml"), "--check")
    assert demo.returncode == 0, demo.stderr
    assert yaml.safe_load(demo.stdout)["cache"]["host_kv_mib"] == 8192
    # The model profiles may need plugins (fp8 KV, MTP) and name checkpoints this machine may
    # lack: --check fails on those only (the 27B one's keys and values are tested in test_profile.py).
    shipped = sorted(p for p in CONFIGS.glob("*.yaml") if p.name != "demo.yaml")
    assert len(shipped) >= 3
    for profile in shipped:
        big = serve("--profile", str(profile), "--check", env={"NINFER_PLUGINS": None})
        if big.returncode == 0:
            assert yaml.safe_load(big.stdout)["cache"]["host_kv_mib"] == 8192, profile.name
        else:
            lines = big.stderr.splitlines()
            assert big.returncode == 2 and lines, big.stderr
            assert all("no plugin provides" in line or line.endswith(": no such checkpoint directory")
                       for line in lines), big.stderr


def test_check_prints_the_canonical_dtype_for_vllm_names():
    for given, canonical in [("bfloat16", "bf16"), ("HALF", "fp16"), ("float", "fp32")]:
        result = serve("tiny:qwen3", "--dtype", given, "--check")
        assert result.returncode == 0, result.stderr
        assert yaml.safe_load(result.stdout)["dtype"] == canonical


def test_check_uses_the_demo_profile_and_redacts_env_api_key(tmp_path):
    result = serve("--check")
    assert result.returncode == 0 and yaml.safe_load(result.stdout)["model"] == "tiny:qwen3"
    profile = tmp_path / "p.yaml"
    profile.write_text("model: tiny:qwen3\nserver:\n  api_key: ${NINFER_TEST_API_KEY}\n")
    result = serve("--profile", str(profile), "--check", env={"NINFER_TEST_API_KEY": "s3cret-value"})
    assert result.returncode == 0
    assert yaml.safe_load(result.stdout)["server"]["api_key"] == "<redacted>"
    assert "s3cret-value" not in result.stdout + result.stderr
    result = serve("--profile", str(profile), "--check")
    assert result.returncode == 2
    assert "server.api_key" in result.stderr and "NINFER_TEST_API_KEY" in result.stderr


def test_unknown_plugin_names_fail_check_as_they_fail_startup():
    checked = serve("tiny:qwen3", "--kv-dtype", "fp9", "--check")
    started = serve("tiny:qwen3", "--kv-dtype", "fp9", "--device", "cpu", "--port", "1")
    assert checked.returncode == started.returncode == 2
    expected = "ninfer-serve: error: engine.kv_dtype: no plugin provides kv_dtype 'fp9' (available: bf16)"
    assert checked.stderr.splitlines() == started.stderr.splitlines() == [expected]
    assert checked.stdout == ""  # no profile printed for one that cannot start


def test_list_plugins_lists_every_kind():
    result = serve("--list-plugins")
    assert result.returncode == 0, result.stderr
    for kind in KINDS.values():
        assert f"\n{kind}:" in "\n" + result.stdout
    assert "qwen3" in result.stdout and "not loaded (allowlist)" in result.stdout
    assert "selected by the profile:" in result.stdout


def test_list_plugins_does_not_load_the_web_stack():
    """Every installed plugin (protocols included) registers without importing Litestar."""
    code = ("import sys\nfrom ninfer.cli.serve import main\n"
            "assert main(['tiny:qwen3', '--list-plugins']) == 0\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'litestar'))\n")
    env = {k: v for k, v in os.environ.items() if k != "NINFER_PLUGINS"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 0, result.stderr
    assert "openai_completions" in result.stdout
    assert result.stdout.splitlines()[-1] == "[]", result.stdout.splitlines()[-1]


# A stand-in for kv_native (which imports torch) that provides the demo profile's kv_dtype.
FAKE_KV_PLUGIN = """
import types
import ninfer.plugins
from ninfer.hookspecs import hookimpl

class FakeKv:
    @hookimpl
    def register_kv_dtypes(self, register):
        register(types.SimpleNamespace(name="bf16", description=""))

    @hookimpl
    def register_model_families(self, register):
        register(types.SimpleNamespace(name="qwen3", description=""))

def load_registry(allow=None):
    registry = ninfer.plugins.PluginRegistry(allow)
    registry.register_plugin(FakeKv(), name="fake_kv")
    return registry

ninfer.plugins.load_registry = load_registry
"""


def test_help_check_and_list_plugins_do_not_import_torch():
    code = (FAKE_KV_PLUGIN + "import sys\nfrom ninfer.cli.serve import main\n"
            "assert main(['--check']) == 0 and main(['--list-plugins']) == 0\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                            env={**os.environ, **LIGHT})
    assert result.returncode == 0, result.stderr
    assert serve("--help").returncode == 0


@pytest.fixture
def restore_logging():
    yield
    logger.remove()
    logger.add(lambda message: sys.stderr.write(message))  # loguru's default sink, following pytest's capture


class _KvPlugin:
    @hookimpl
    def register_kv_dtypes(self, register):
        register(types.SimpleNamespace(name="bf16", description=""))

    @hookimpl
    def register_model_families(self, register):  # tiny:qwen3 names it
        register(types.SimpleNamespace(name="qwen3", description=""))


def _fake_registry(allow=None) -> PluginRegistry:
    registry = PluginRegistry(allow)
    registry.register_plugin(_KvPlugin(), name="fake_kv")
    return registry


def test_startup_logs_a_summary_then_runs_the_server(monkeypatch, capsys, restore_logging):
    calls: list[tuple[Profile, PluginRegistry]] = []
    server = types.ModuleType("ninfer.server")
    server.run = lambda profile, registry: calls.append((profile, registry))
    monkeypatch.setitem(sys.modules, "ninfer.server", server)
    monkeypatch.setattr("ninfer.plugins.load_registry", _fake_registry)
    assert main(["tiny:qwen3", "--max-concurrency", "2", "--device", "cpu"]) == 0
    (profile, registry), = calls
    assert profile.cache.max_private_continuations == 4 and registry.names("kv_dtype") == ["bf16"]
    err = capsys.readouterr().err
    for text in ["model tiny:qwen3", "device cpu", "dtype fp32", "concurrency 2", "speculative decoding: off",
                 "kv_dtype bf16 (fake_kv)"]:
        assert text in err, text


def test_descriptor_limits_are_honoured_without_a_warning(monkeypatch, capsys, restore_logging):
    """Issue #23's options: the profile keeps them, and the context cache honours them."""
    server = types.ModuleType("ninfer.server")
    server.run = lambda profile, registry: None
    monkeypatch.setitem(sys.modules, "ninfer.server", server)
    monkeypatch.setattr("ninfer.plugins.load_registry", _fake_registry)
    assert main(["tiny:qwen3", "--device", "cpu", "--max-shared-prefixes", "6"]) == 0
    assert "not honoured" not in capsys.readouterr().err
    check = serve("tiny:qwen3", "--max-shared-prefixes", "6", "--check")
    assert check.returncode == 0 and "max_shared_prefixes: 6" in check.stdout
    assert "warning" not in check.stderr


def test_the_summary_states_the_descriptor_limits_and_what_auto_means_on_cpu(monkeypatch, capsys,
                                                                             restore_logging):
    server = types.ModuleType("ninfer.server")
    server.run = lambda profile, registry: None
    monkeypatch.setitem(sys.modules, "ninfer.server", server)
    monkeypatch.setattr("ninfer.plugins.load_registry", _fake_registry)
    assert main(["tiny:qwen3", "--device", "cpu", "--max-concurrency", "2", "--max-context", "1024",
                 "--kv-capacity", "auto", "--max-shared-prefixes", "6"]) == 0
    err = capsys.readouterr().err
    assert "context cache: up to 4 private continuations, 6 shared prefixes, 2 long anchors per continuation" in err
    assert "not used yet" not in err and "evicted LRU" not in err
    assert "KV pool auto (1024 context x 2 concurrency on CPU)" in err and "free memory" not in err
    assert main(["tiny:qwen3", "--device", "cpu", "--model-id", "public-name"]) == 0
    assert "served as public-name" in capsys.readouterr().err


def test_a_kv_pool_below_the_context_is_a_warning_on_check_and_startup(monkeypatch, capsys, restore_logging):
    check = serve("tiny:qwen3", "--kv-capacity", "100", "--max-context", "4096", "--check")
    assert check.returncode == 0, check.stderr
    assert re.search(r"warning: engine.kv_capacity: 100 tokens is below engine.max_context \(4096\)", check.stderr)
    assert "warning" not in serve("tiny:qwen3", "--kv-capacity", "4096", "--max-context", "4096", "--check").stderr
    server = types.ModuleType("ninfer.server")
    server.run = lambda profile, registry: None
    monkeypatch.setitem(sys.modules, "ninfer.server", server)
    monkeypatch.setattr("ninfer.plugins.load_registry", _fake_registry)
    assert main(["tiny:qwen3", "--device", "cpu", "--kv-capacity", "100", "--max-context", "4096"]) == 0
    assert re.search(r"WARNING engine.kv_capacity: 100 tokens is below", capsys.readouterr().err)


def test_a_model_that_cannot_load_fails_check_and_startup_before_loading(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    cases = [(str(tmp_path / "absent"), "no such checkpoint directory"), (str(empty), "no config.json"),
             ("tiny:nosuchfamily", "no model family 'nosuchfamily' (available: qwen3)")]
    for model, why in cases:
        for mode in (["--check"], ["--device", "cpu", "--port", "1"]):
            result = serve(model, *mode)
            assert result.returncode == 2, (model, mode, result.stderr)
            assert result.stderr.startswith(f"ninfer-serve: error: model: {model}: {why}"), result.stderr
            assert "--family" not in result.stderr and result.stdout == ""


def test_a_malformed_cost_presets_file_stops_check_and_startup(tmp_path):
    bad = tmp_path / "costs.yaml"
    bad.write_text("transfer:\n  host_gbps: fast\n")
    for extra in (["--check"], ["--port", "1"]):
        run = serve("tiny:qwen3", "--context-cost-presets", str(bad), *extra)
        assert run.returncode == 2 and "engine.context_cost_presets" in run.stderr
        assert "transfer.host_gbps: expected a positive number" in run.stderr
    good = tmp_path / "good.yaml"
    good.write_text("transfer:\n  host_gbps: 12\n")
    assert serve("tiny:qwen3", "--context-cost-presets", str(good), "--check").returncode == 0


def test_lora_modules_take_vllms_spaced_form_and_missing_paths_exit_2(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    check = serve("tiny:qwen3", "--lora-modules", f"A={a}", f"B={b},C={a}", "--check")
    assert check.returncode == 0, check.stderr
    assert yaml.safe_load(check.stdout)["server"]["lora_modules"] == [f"A={a}", f"B={b}", f"C={a}"]
    reason = "server.lora_modules: the adapter 'B': /no/such/adapter: no such adapter directory or file"
    for extra in (["--check"], ["--port", "1"]):  # --check refuses what startup refuses, before any model loads
        result = serve("tiny:qwen3", "--lora-modules", f"A={a}", "B=/no/such/adapter", *extra)
        assert result.returncode == 2 and reason in result.stderr, result.stderr


def test_missing_server_module_exits_1(monkeypatch, capsys, restore_logging):
    monkeypatch.setitem(sys.modules, "ninfer.server", None)
    monkeypatch.setattr("ninfer.plugins.load_registry", _fake_registry)
    assert main(["tiny:qwen3", "--device", "cpu"]) == 1
    assert "HTTP server is not available" in capsys.readouterr().err


LOG_SCRIPT = ("import sys\nfrom loguru import logger\nfrom ninfer.log import setup_logging\n"
              "setup_logging(sys.argv[1])\nlogger.info('server ready')\nlogger.debug('planning detail')\n")


def test_log_lines_have_the_format_and_no_escapes_when_redirected():
    result = subprocess.run([sys.executable, "-c", LOG_SCRIPT, "info"], capture_output=True, text=True, timeout=60)
    assert LOG_LINE.match(result.stderr.rstrip("\n")), result.stderr
    assert "\x1b" not in result.stderr
    debug = subprocess.run([sys.executable, "-c", LOG_SCRIPT, "debug"], capture_output=True, text=True, timeout=60)
    assert "DEBUG planning detail" in debug.stderr
    off = subprocess.run([sys.executable, "-c", LOG_SCRIPT, "off"], capture_output=True, text=True, timeout=60)
    assert off.stderr == ""


def test_log_lines_are_coloured_on_a_terminal():
    controller, terminal = pty.openpty()
    try:
        subprocess.run([sys.executable, "-c", LOG_SCRIPT, "info"], stderr=terminal, stdout=subprocess.DEVNULL,
                       timeout=60, check=True)
        output = os.read(controller, 4096).decode()
    finally:
        os.close(controller)
        os.close(terminal)
    assert "\x1b[" in output and "server ready" in output


@pytest.mark.parametrize(
    "flags, key",
    [
        (["--vision"], "media.vision"),
        (["--media-cache-mib", "10"], "media.media_cache_mib"),
        (["--media-live-mib", "4096"], "media.media_live_mib"),
        (["--media-preprocess-threads", "4"], "media.media_preprocess_threads"),
    ],
)
def test_options_this_build_cannot_honour_are_refused_at_startup(flags, key):
    """Refused before the model loads, and so by --check."""
    env = {**os.environ, "NINFER_PLUGINS": "qwen3_reasoning,kv_native"}
    check = subprocess.run([SERVE, *flags, "--check"], capture_output=True, text=True, env=env, timeout=60)
    assert check.returncode == 2 and key in check.stderr
    start = subprocess.run([SERVE, *flags, "--port", "1"], capture_output=True, text=True, env=env, timeout=60)
    assert start.returncode == 2 and key in start.stderr


def test_the_request_log_path_is_checked_before_the_model_loads(tmp_path):
    """A missing directory, a directory, or a path into the model: exit 2 on --check and at
    startup, naming the key and why. A good path passes --check and leaves no file."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "weights.safetensors").write_bytes(b"")
    (model / "link").symlink_to(model / "weights.safetensors")
    cases = [(tmp_path / "absent" / "log.jsonl", "does not exist"), (tmp_path, "is a directory"),
             (model / "log.jsonl", "resolves into the model"), (model / "link", "resolves into the model"),
             (tmp_path / "up" / ".." / "model" / "weights.safetensors", "resolves into the model")]
    (tmp_path / "up").mkdir()
    for i, (path, why) in enumerate(cases):
        for mode in (["--check"], ["--port", "1"])[: 2 if i in (0, 2) else 1]:  # startup runs the same check
            result = serve(str(model), "--request-log-jsonl", str(path), *mode)
            assert result.returncode == 2, (path, mode, result.stderr)
            assert "logging.request_log_jsonl" in result.stderr and why in result.stderr, result.stderr
    good = tmp_path / "campaign.jsonl"
    result = serve(str(model), "--request-log-jsonl", str(good), "--check")
    assert result.returncode == 0, result.stderr
    assert "request_log_jsonl: " + str(good) in result.stdout and not good.exists()
