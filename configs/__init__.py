"""Startup profiles shipped with ninfer (``demo.yaml`` is the embedded default)."""
