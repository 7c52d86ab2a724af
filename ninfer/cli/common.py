"""Pieces the console scripts share: how the model is chosen, how problems are printed."""

from __future__ import annotations

import argparse
import sys
from typing import Container, Mapping

from ninfer import __version__
from ninfer.profile.flags import add_profile_flags


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """MODEL_PATH and --profile: the two ways to name what to load."""
    parser.add_argument("model", nargs="?", metavar="MODEL_PATH",
                        help="checkpoint directory, tiny:FAMILY or random:SHAPE; overrides the profile's model")
    parser.add_argument("--profile", metavar="FILE",
                        help="startup profile (YAML); without it and MODEL_PATH the packaged demo profile is used")


def add_version_and_profile_flags(parser: argparse.ArgumentParser, omit: Container[str] = (),
                                  help_texts: Mapping[str, str] = {}) -> None:
    """--version, then one flag per profile option (they come last in --help); see add_profile_flags."""
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    add_profile_flags(parser, omit, help_texts)


def report(prog: str, errors: list[str], label: str = "error") -> None:
    """One ``prog: label: message`` line per problem on stderr."""
    for message in errors:
        print(f"{prog}: {label}: {message}", file=sys.stderr)
