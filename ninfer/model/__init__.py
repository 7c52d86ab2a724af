"""Model-side contracts and shared building blocks (no family-specific code)."""
