"""Guided (constrained) decoding: the request-level guide and the engine's mask machinery."""
