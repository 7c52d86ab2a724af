"""Docs that must follow the code: docs/architecture.md names every core module."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MODULES = sorted(p.relative_to(ROOT / "ninfer") for p in (ROOT / "ninfer").rglob("*.py") if p.name != "__init__.py")


def _named(doc: str, module: Path) -> bool:
    """By its path under ninfer/ or the repository (``engine/stats.py``), or dotted (``ninfer.engine.stats``)."""
    spellings = [module.as_posix(), f"ninfer/{module.as_posix()}", "ninfer." + ".".join(module.with_suffix("").parts)]
    return any(re.search(rf"(?<![\w/.]){re.escape(s)}(?![\w])", doc) for s in spellings)


@pytest.mark.parametrize("module", MODULES, ids=str)
def test_architecture_names_every_core_module(module):
    doc = (ROOT / "docs" / "architecture.md").read_text()
    assert _named(doc, module), f"docs/architecture.md does not mention ninfer/{module}"
