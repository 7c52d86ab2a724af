"""The plugin contract: every hook documented, exercised, and loadable from entry points."""

from __future__ import annotations

import ast
import importlib
import inspect
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from ninfer import hookspecs
from ninfer.hookspecs import hookimpl
from ninfer.plugins import KINDS, PluginRegistry, UnknownCapabilityError, load_registry, DuplicateCapabilityError

ROOT = Path(__file__).resolve().parents[1]
HOOKS = [name for name, fn in inspect.getmembers(hookspecs, inspect.isfunction) if name.startswith("register_")]


def test_every_hook_has_a_kind():
    assert sorted(HOOKS) == sorted(KINDS)


@pytest.mark.parametrize("hook", HOOKS)
def test_every_hook_is_documented(hook):
    doc = (ROOT / "docs" / "plugins.md").read_text()
    assert re.search(rf"^#+ .*`{hook}`", doc, re.M), f"docs/plugins.md has no section for {hook}"
    assert getattr(hookspecs, hook).__doc__.strip(), f"{hook} has no docstring"


#: hooks no built-in plugin implements yet, and the work that will (each must go or get one)
AWAITING_IMPLEMENTATION = {
}


@pytest.mark.parametrize("hook", HOOKS)
def test_every_hook_is_exercised_by_a_real_plugin(hook):
    """Each hook has a built-in implementation, loaded through its entry point like a third
    party's, whose capabilities are the descriptor type the hook documents (no stand-ins)."""
    if hook in AWAITING_IMPLEMENTATION:
        pytest.skip(f"{hook}: no implementation until {AWAITING_IMPLEMENTATION[hook]}")
    kind = KINDS[hook]
    registry = load_registry()
    provided = registry.items[kind]
    assert provided, f"no built-in plugin implements {hook}"
    documented = re.search(r"register\((ninfer\.[\w.]+)\.(\w+)\(", getattr(hookspecs, hook).__doc__)
    assert documented, f"{hook}'s docstring names no descriptor type"
    descriptor = getattr(importlib.import_module(documented.group(1)), documented.group(2))
    for name, item in provided.items():
        assert isinstance(item.obj, descriptor), (hook, name, type(item.obj))
        assert item.obj.name == name and item.distribution and name in registry.describe()


def test_hooks_awaiting_an_implementation_really_have_none():
    registry = load_registry()
    for hook in AWAITING_IMPLEMENTATION:
        assert not registry.items[KINDS[hook]], f"{hook} has an implementation now: drop it from the list"


def test_builtin_plugins_load_through_entry_points():
    registry = load_registry()
    assert "qwen3" in registry.names("model_family")
    assert "qwen3_moe" in registry.names("model_family")
    assert "bf16" in registry.names("kv_dtype")
    assert registry.items["model_family"]["qwen3"].distribution == "ninfer"
    assert "tokenize" in registry.names("protocol")


def test_families_name_their_own_parsers_and_the_core_assumes_none():
    """Markup formats are a family's (or the profile's) choice: a family that names no
    parser gets none, rather than Qwen's."""
    from ninfer.model.family import ModelFamily

    bare = ModelFamily(name="x", architectures=("X",), model_types=("x",), build=lambda *a: None)
    assert bare.reasoning_parser is None and bare.tool_parser is None
    families = load_registry().items["model_family"]
    assert families["qwen3_5"].obj.tool_parser == "qwen3_xml"
    assert families["qwen3"].obj.tool_parser == "hermes_json"


def test_example_third_party_plugin_is_loaded_from_its_own_distribution():
    registry = load_registry()
    provided = registry.items["reasoning_parser"]["bracket_think"]
    assert provided.distribution == "ninfer-example-plugin"
    assert provided.obj.start == "[THINK]"


def test_allowlist_env_and_profile_intersect(monkeypatch):
    monkeypatch.setenv("NINFER_PLUGINS", "qwen3,kv_native")
    registry = load_registry()
    assert registry.names("model_family") == ["qwen3"]
    assert "bracket_think" not in registry.names("reasoning_parser")
    assert "example_bracket_reasoning" in registry.skipped
    registry = load_registry(allow=["kv_native"])
    assert registry.names("model_family") == []
    assert registry.names("kv_dtype") == ["bf16"]


def test_unknown_name_lists_available():
    registry = load_registry()
    with pytest.raises(UnknownCapabilityError) as err:
        registry.get("kv_dtype", "fp7", key="engine.kv_dtype")
    assert "engine.kv_dtype" in str(err.value) and "bf16" in str(err.value)


def test_duplicate_names_are_rejected():
    class Plugin:
        @staticmethod
        @hookimpl
        def register_tool_parsers(register):
            register(SimpleNamespace(name="same"))

    registry = PluginRegistry()
    registry.register_plugin(Plugin(), name="a")
    registry.register_plugin(Plugin(), name="b")
    with pytest.raises(DuplicateCapabilityError):
        registry.names("tool_parser")


def test_protocol_packages_import_no_other_protocol_package():
    """A protocol plugin translates and renders; what protocols share lives in ninfer.frontend."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent / "plugins" / "protocols"
    offenders = []
    for path in sorted(root.rglob("*.py")):
        own = path.relative_to(root).parts[0].removesuffix(".py")
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            for name in names:
                parts = name.split(".")
                if parts[:2] == ["ninfer_plugins", "protocols"] and len(parts) > 2 and parts[2] != own:
                    offenders.append(f"{path.relative_to(root)} imports {name}")
    assert offenders == []


# -- what plugins import ---------------------------------------------------------------------


def _import_table() -> list[str]:
    """The modules docs/plugins.md's "What a plugin may import" table lists (``pkg.*``: a package).

    A cell's ``.name`` is a sibling of the absolute name before it.
    """
    doc = (ROOT / "docs" / "plugins.md").read_text()
    section = doc[doc.index("## What a plugin may import"):]
    names = []
    for line in section.splitlines():
        if not line.startswith("| `"):
            continue
        package = ""
        for name in re.findall(r"`([\w.*]+)`", line.split("|")[1]):
            if name.startswith("."):
                name = package + name
            else:
                package = name.rpartition(".")[0]
            names.append(name)
    return names


def _ninfer_imports_of_plugins() -> dict[str, str]:
    """Every ``ninfer.*`` module a file under plugins/ imports, with one file that does."""
    found: dict[str, str] = {}
    for path in sorted((ROOT / "plugins").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                modules = [f"ninfer.{a.name}" for a in node.names] if node.module == "ninfer" else [node.module]
            elif isinstance(node, ast.Import):
                modules = [a.name for a in node.names]
            else:
                continue
            for module in modules:
                if module.startswith("ninfer."):
                    found.setdefault(module, str(path.relative_to(ROOT)))
    return found


def test_every_ninfer_module_a_plugin_imports_is_in_the_import_table():
    table = _import_table()
    assert "ninfer.capabilities" in table and "ninfer.model.kv" in table  # the parse found the table

    def listed(module: str) -> bool:
        return any(module == name or (name.endswith(".*") and module.startswith(name[:-1])) for name in table)

    missing = {module: where for module, where in _ninfer_imports_of_plugins().items() if not listed(module)}
    assert not missing, f"docs/plugins.md's import table lacks what plugins import: {missing}"
    for name in table:  # and the table names modules that exist
        if name.startswith("ninfer.") and not name.endswith(".*"):
            path = ROOT / name.replace(".", "/")
            assert path.with_suffix(".py").exists() or (path / "__init__.py").exists(), name


def test_a_reasoning_parser_names_its_markers():
    """The core has no format's defaults: a plugin that forgets its markers fails at import."""
    from ninfer.capabilities import ReasoningParser

    with pytest.raises(TypeError):
        ReasoningParser(name="x")
    with pytest.raises(TypeError):
        ReasoningParser(name="x", start="<t>", end="</t>")  # budget_close too
    parsers = load_registry().items["reasoning_parser"]
    assert parsers["qwen3"].obj.end == "</think>" and parsers["qwen3"].obj.budget_close.endswith("</think>\n\n")
