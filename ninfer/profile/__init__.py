"""Startup profiles: one YAML file describes one reproducible server.

``load_profile`` reads and validates (YAML, ``${ENV}`` references, CLI-style
overrides), ``resolve`` fills in derived defaults, ``to_yaml`` prints the result.
Nothing here imports torch, so `ninfer-serve --check` stays fast.
"""

from ninfer.profile.load import ProfileError, default_profile_path, load_profile, to_yaml
from ninfer.profile.resolve import check_selections, resolve
from ninfer.profile.schema import (
    Cache,
    Engine,
    Logging,
    Media,
    Plugins,
    Profile,
    Reasoning,
    Sampling,
    Server,
    Speculative,
    Tools,
)

__all__ = [
    "Cache",
    "Engine",
    "Logging",
    "Media",
    "Plugins",
    "Profile",
    "ProfileError",
    "Reasoning",
    "Sampling",
    "Server",
    "Speculative",
    "Tools",
    "check_selections",
    "default_profile_path",
    "load_profile",
    "resolve",
    "to_yaml",
]
