"""The HTTP server: ``run(profile, registry)`` serves one model until SIGTERM.

Imported lazily so that protocol plugins can import the light helpers
(:mod:`ninfer.server.sse`, :mod:`ninfer.server.errors`, ...) without loading torch.
"""

from __future__ import annotations

from typing import Any

__all__ = ["run"]


def run(profile: Any, registry: Any) -> None:
    """Serve ``profile`` (already validated) with the plugins in ``registry``."""
    from ninfer.server.run import run as serve

    serve(profile, registry)
