"""Plugin loading and the name-keyed registry of capabilities.

Plugins are modules (or objects) implementing hooks from :mod:`ninfer.hookspecs`.
They are discovered through the ``ninfer`` entry-point group, built-in ones included,
optionally restricted by an allowlist (profile ``plugins.allow`` and the
``NINFER_PLUGINS`` environment variable; when both are set a plugin must be in both).
"""

from __future__ import annotations

import os
from importlib.metadata import entry_points
from typing import Any, Iterable

import attrs
import pluggy

from ninfer import hookspecs

ENTRY_POINT_GROUP = "ninfer"
ALLOWLIST_ENV = "NINFER_PLUGINS"

#: hook name -> capability kind, in the order ``--list-plugins`` prints them
KINDS: dict[str, str] = {
    "register_model_families": "model_family",
    "register_kv_dtypes": "kv_dtype",
    "register_speculative_backends": "speculative_backend",
    "register_tool_parsers": "tool_parser",
    "register_reasoning_parsers": "reasoning_parser",
    "register_protocols": "protocol",
    "register_guided_decoding_backends": "guided_decoding",
    "register_weight_formats": "weight_format",
}


class UnknownCapabilityError(LookupError):
    """A profile selected a name that no loaded plugin provides."""

    def __init__(self, kind: str, name: str, available: list[str], key: str | None = None):
        self.kind, self.name, self.available, self.key = kind, name, available, key
        where = f"{key}: " if key else ""
        names = ", ".join(available) if available else "none installed"
        super().__init__(f"{where}no plugin provides {kind} {name!r} (available: {names})")


class DuplicateCapabilityError(ValueError):
    pass


class PluginLoadError(RuntimeError):
    """An installed plugin could not be imported."""


@attrs.frozen
class Provided:
    """One capability and where it came from."""

    kind: str
    name: str
    obj: Any
    plugin: str
    distribution: str


def env_allowlist() -> set[str] | None:
    raw = os.environ.get(ALLOWLIST_ENV)
    if raw is None:
        return None
    return {p.strip() for p in raw.split(",") if p.strip()}


class PluginRegistry:
    """Loads plugins and answers "which object provides kind K named N"."""

    def __init__(self, allow: Iterable[str] | None = None):
        self.pm = pluggy.PluginManager("ninfer")
        self.pm.add_hookspecs(hookspecs)
        self._allow = set(allow) if allow is not None else None
        self._dist: dict[str, str] = {}
        self._items: dict[str, dict[str, Provided]] | None = None
        self.skipped: list[str] = []

    # -- loading -------------------------------------------------------------
    def allowed(self, plugin_name: str) -> bool:
        env = env_allowlist()
        return all(a is None or plugin_name in a for a in (self._allow, env))

    def load_entry_points(self) -> "PluginRegistry":
        for ep in sorted(entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
            if self.pm.get_plugin(ep.name) is not None:
                continue
            if not self.allowed(ep.name):
                self.skipped.append(ep.name)
                continue
            dist = ep.dist.name if ep.dist is not None else "(unknown)"
            try:
                plugin = ep.load()
            except Exception as exc:  # a broken plugin must name itself, not crash obscurely
                raise PluginLoadError(f"plugin {ep.name!r} from {dist} failed to load: {exc!r}") from exc
            self.register_plugin(plugin, name=ep.name, distribution=dist)
        return self

    def register_plugin(self, plugin: Any, name: str, distribution: str = "(registered directly)") -> None:
        """Register a plugin object; tests use this to add plugins without packaging."""
        self.pm.register(plugin, name=name)
        self._dist[name] = distribution
        self._items = None

    # -- queries -------------------------------------------------------------
    def _collect(self) -> dict[str, dict[str, Provided]]:
        items: dict[str, dict[str, Provided]] = {kind: {} for kind in KINDS.values()}
        for hook_name, kind in KINDS.items():
            for impl in getattr(self.pm.hook, hook_name).get_hookimpls():
                plugin = impl.plugin_name

                def register(obj: Any, _kind=kind, _plugin=plugin) -> None:
                    name = obj.name
                    if name in items[_kind]:
                        other = items[_kind][name].plugin
                        raise DuplicateCapabilityError(
                            f"{_kind} {name!r} is provided by both {other!r} and {_plugin!r}"
                        )
                    items[_kind][name] = Provided(_kind, name, obj, _plugin, self._dist.get(_plugin, "?"))

                impl.function(register)
        return items

    @property
    def items(self) -> dict[str, dict[str, Provided]]:
        if self._items is None:
            self._items = self._collect()
        return self._items

    def names(self, kind: str) -> list[str]:
        return sorted(self.items[kind])

    def get(self, kind: str, name: str, key: str | None = None) -> Any:
        try:
            return self.items[kind][name].obj
        except KeyError:
            raise UnknownCapabilityError(kind, name, self.names(kind), key) from None

    def all(self, kind: str) -> list[Any]:
        return [p.obj for _, p in sorted(self.items[kind].items())]

    def describe(self) -> str:
        """Human-readable listing for ``ninfer-serve --list-plugins``."""
        lines = []
        for kind in KINDS.values():
            lines.append(f"{kind}:")
            provided = self.items[kind]
            if not provided:
                lines.append("  (none)")
            for name, p in sorted(provided.items()):
                desc = getattr(p.obj, "description", "") or ""
                lines.append(f"  {name:<22} {p.distribution} ({p.plugin})" + (f"  {desc}" if desc else ""))
        if self.skipped:
            lines.append("not loaded (allowlist): " + ", ".join(self.skipped))
        return "\n".join(lines)


def load_registry(allow: Iterable[str] | None = None) -> PluginRegistry:
    """The registry of every installed plugin passing the allowlists."""
    return PluginRegistry(allow).load_entry_points()
