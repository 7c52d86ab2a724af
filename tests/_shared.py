"""Where the shared spec and client fixtures live: ``../shared`` beside the checkout."""

from __future__ import annotations

from pathlib import Path

_CANDIDATES = [Path(__file__).resolve().parents[2] / "shared", Path("/work/shared")]


def shared_path(*parts: str) -> Path:
    """``shared/<parts>`` from the first place that has it (CI lays shared/ beside the clone)."""
    for root in _CANDIDATES:
        if (root / Path(*parts)).exists():
            return root / Path(*parts)
    return _CANDIDATES[0] / Path(*parts)
