"""Reading a profile: YAML + environment references + overrides -> a validated :class:`Profile`.

cattrs turns the nested mapping into the attrs classes; each field's hook is that
field's parser, so type errors, range errors and unknown keys all come back together
from one pass, each under its key path.
"""

from __future__ import annotations

import difflib
import os
import re
from importlib.resources import files
from pathlib import Path
from typing import Any, Mapping

import attrs
import cattrs
import yaml
from cattrs.errors import ClassValidationError, ForbiddenExtraKeysError
from cattrs.gen import make_dict_structure_fn, override

from ninfer.profile.flags import override_names
from ninfer.profile.rules import REDACTED, cross_checks
from ninfer.profile.schema import METADATA_KEY, SECTIONS, Profile, options

_ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")


class ProfileError(ValueError):
    """A profile that cannot be used; ``errors`` holds every problem as ``key.path: message``."""

    def __init__(self, errors: list[str]):
        super().__init__("\n".join(errors))
        self.errors = errors


def default_profile_path() -> str:
    """The packaged demo profile, used when neither a profile nor a model is given."""
    return str(files("ninfer_configs").joinpath("demo.yaml"))


# -- structuring ----------------------------------------------------------------------
def _field_hooks(cls: type) -> dict[str, Any]:
    return {
        f.name: override(struct_hook=lambda value, _type, parse=f.metadata[METADATA_KEY].parse: parse(value))
        for f in attrs.fields(cls)
        if METADATA_KEY in f.metadata
    }


def _section_hook(name: str, cls: type):
    structure = make_dict_structure_fn(cls, _converter, _cattrs_forbid_extra_keys=True, **_field_hooks(cls))

    def hook(value: Any, _type: type) -> Any:
        if value is None:  # an empty section in YAML (``engine:``)
            value = {}
        if not isinstance(value, Mapping):
            raise ValueError(f"expected a mapping of {name} keys, got {value!r}")
        return structure(value, _type)

    return hook


_converter = cattrs.Converter(detailed_validation=True, forbid_extra_keys=True)
for _name, _cls in SECTIONS.items():
    _converter.register_structure_hook(_cls, _section_hook(_name, _cls))
_converter.register_structure_hook(Profile, _section_hook("top-level", Profile))


def _problems(exc: BaseException, path: tuple[str, ...]) -> list[tuple[tuple[str, ...], str]]:
    """Flatten cattrs' exception tree into ``(key path, message)`` pairs."""
    if isinstance(exc, ClassValidationError):
        with_notes, without = exc.group_exceptions()
        out = [p for sub, note in with_notes for p in _problems(sub, (*path, note.name))]
        return out + [p for sub in without for p in _problems(sub, path)]
    if isinstance(exc, ForbiddenExtraKeysError):
        allowed = [f.name for f in attrs.fields(exc.cl)]
        out = []
        for key in sorted(map(str, exc.extra_fields)):
            name = key.replace("-", "_")
            # a key moved into the wrong section (vLLM flags turned into YAML) is meant where it exists
            elsewhere = [k if "." in k else f"the top-level {k}"
                         for k, _, _ in options() if k.rsplit(".", 1)[-1] == name]
            close = elsewhere or difflib.get_close_matches(name, allowed, n=1)
            hint = f"did you mean {' or '.join(close)}?" if close else "allowed: " + ", ".join(allowed)
            out.append(((*path, key), f"unknown key ({hint})"))
        return out
    return [(path, str(exc))]


def _structure(raw: dict[str, Any]) -> tuple[Profile | None, list[str]]:
    """Structure ``raw``; on failure, also cross-check what remains once the bad keys are dropped."""
    try:
        return _converter.structure(raw, Profile), []
    except ClassValidationError as e:
        problems = _problems(e, ())
    errors = [f"{'.'.join(path) or 'profile'}: {msg}" for path, msg in problems]
    pruned = {k: dict(v) if isinstance(v, dict) else v for k, v in raw.items()}
    for path, _ in problems:
        parent = pruned.get(path[0]) if len(path) == 2 else pruned
        if path and isinstance(parent, dict):
            parent.pop(path[-1], None)
    try:
        rest = cross_checks(_converter.structure(pruned, Profile))
    except ClassValidationError:
        return None, errors
    bad = {".".join(path) for path, _ in problems}
    return None, errors + [m for m in rest if m.split(":", 1)[0] not in bad]


# -- raw mapping ----------------------------------------------------------------------
def _read(path: str) -> dict[str, Any]:
    try:
        data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except OSError as e:
        raise ProfileError([f"{path}: cannot read profile: {e.strerror or e}"]) from None
    except yaml.YAMLError as e:
        raise ProfileError([f"{path}: not valid YAML: {e}"]) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ProfileError([f"{path}: expected a mapping of profile sections, got {type(data).__name__}"])
    return data


def _substitute(value: Any, path: str, errors: list[str]) -> Any:
    """Replace ``${NAME}`` in every string with the environment variable's value."""
    if isinstance(value, dict):
        return {k: _substitute(v, f"{path}.{k}" if path else str(k), errors) for k, v in value.items()}
    if isinstance(value, list):
        return [_substitute(v, f"{path}[{i}]", errors) for i, v in enumerate(value)]
    if not isinstance(value, str):
        return value

    def lookup(m: re.Match) -> str:
        if m.group(1) not in os.environ:
            errors.append(f"{path}: environment variable {m.group(1)} is not set")
            return m.group(0)
        return os.environ[m.group(1)]

    return _ENV_REF.sub(lookup, value)


def _apply_overrides(raw: dict[str, Any], overrides: Mapping[str, Any], errors: list[str]) -> None:
    flat = override_names()
    keys = {key for key, _, _ in options()}
    for name, value in overrides.items():
        if name in keys:
            key = name
        elif name in flat:
            key, negate = flat[name]
            value = (not value) if negate and isinstance(value, bool) else value
        else:
            close = difflib.get_close_matches(name, [*flat, *keys], n=1)
            errors.append(f"{name}: unknown option" + (f" (did you mean {close[0]}?)" if close else ""))
            continue
        if "." not in key:
            raw[key] = value
            continue
        section, field = key.split(".", 1)
        if raw.get(section) is None:
            raw[section] = {}
        if isinstance(raw[section], dict):  # otherwise structuring reports the malformed section
            raw[section][field] = value


def load_profile(path: str | None = None, model: str | None = None,
                 overrides: Mapping[str, Any] | None = None) -> Profile:
    """Read, override and validate a profile; raises :class:`ProfileError` with every problem.

    ``overrides`` maps flat flag names (``max_context``, ``no_prefix_reuse``) or key paths
    (``engine.max_context``) to values and beats both the file and ``model``. With no
    ``path`` and no model anywhere, the packaged demo profile is used. Derived defaults
    stay None; :func:`ninfer.profile.resolve.resolve` fills them in.
    """
    overrides = dict(overrides or {})
    if path is None and model is None and overrides.get("model") is None:
        path = default_profile_path()
    errors: list[str] = []
    raw = _substitute(_read(path), "", errors) if path is not None else {}
    if model is not None:
        raw["model"] = model
    _apply_overrides(raw, overrides, errors)
    profile, problems = _structure(raw)
    errors += problems if profile is None else cross_checks(profile)
    if errors or profile is None:
        raise ProfileError(errors)
    return profile


def to_dict(profile: Profile, redact: bool = True) -> dict:
    """The profile as plain data, every key present, sections in schema order."""
    data = _converter.unstructure(profile)
    if redact and data["server"]["api_key"] is not None:
        data["server"]["api_key"] = REDACTED
    return data


def to_yaml(profile: Profile, redact: bool = True) -> str:
    """The profile as YAML, every key present, sections in schema order."""
    return yaml.safe_dump(to_dict(profile, redact), sort_keys=False, default_flow_style=False, allow_unicode=True)
