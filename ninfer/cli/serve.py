"""``ninfer-serve``: validate a startup profile, then hand it to the HTTP server.

Everything up to the server start (flags, profile, plugin choices) is checked before
any model loads, and failures exit with status 2. ``--check`` runs the same checks
(plugin choices included; only the device is left to startup), so a profile it passes
gets as far as loading the model. ``--help``, ``--check`` and ``--list-plugins`` never
import torch themselves.
"""

from __future__ import annotations

import argparse
import textwrap
from typing import TYPE_CHECKING

from loguru import logger

from ninfer import __version__
from ninfer.cli.common import add_model_arguments, add_version_and_profile_flags, report
from ninfer.profile import ProfileError, check_selections, load_profile, resolve, to_yaml
from ninfer.profile.flags import overrides_from_args
from ninfer.profile.resolve import auto_pool, capacity_warnings, model_errors, not_honoured

if TYPE_CHECKING:
    from ninfer.plugins import PluginRegistry
    from ninfer.profile import Profile

PROG = "ninfer-serve"
USAGE_ERROR = 2


class _HelpFormatter(argparse.HelpFormatter):
    """Wider flag column, and no line breaks inside flag names quoted in help text."""

    def __init__(self, prog: str) -> None:
        super().__init__(prog, max_help_position=34)

    def _split_lines(self, text: str, width: int) -> list[str]:
        return textwrap.wrap(text, width, break_on_hyphens=False)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        formatter_class=_HelpFormatter,
        description="Serve one model over OpenAI- and Anthropic-compatible HTTP APIs.",
        epilog="Every option is also a profile key (see each group's title) and a flag beats the "
        "profile. Defaults shown are the built-in ones. Give null to clear an optional value a "
        "profile sets, e.g. --spec null.",
    )
    add_model_arguments(parser)
    parser.add_argument("--check", action="store_true",
                        help="print the resolved profile as YAML and exit without loading a model")
    parser.add_argument("--list-plugins", action="store_true",
                        help="list installed plugins and the profile's choices, then exit")
    add_version_and_profile_flags(parser)
    return parser


def _report(errors: list[str], label: str = "error") -> None:
    report(PROG, errors, label)


def _registry(profile: Profile) -> PluginRegistry:
    from ninfer.plugins import load_registry

    registry = load_registry(profile.plugins.allow)
    registry.items  # noqa: B018 - collects every capability now, so duplicates fail here
    return registry


def _selected(profile: Profile, registry: PluginRegistry) -> list[str]:
    """What the profile picks for each plugin kind, for ``--list-plugins``."""
    def one(name: str | None) -> list[str] | None:
        return [name] if name else None

    choices = [
        ("kv_dtype", one(profile.engine.kv_dtype), ""),
        ("speculative_backend", one(profile.speculative.backend), "off"),
        ("tool_parser", one(profile.tools.parser), "model family default"),
        ("reasoning_parser", one(profile.reasoning.parser), "model family default"),
        ("protocol", profile.server.protocols, "every installed"),
    ]
    lines = ["selected by the profile:"]
    for kind, names, fallback in choices:
        if not names:
            lines.append(f"  {kind:<22} ({fallback})")
            continue
        missing = [n for n in names if n not in registry.items[kind]]
        note = f"  (not installed: {', '.join(missing)})" if missing else ""
        lines.append(f"  {kind:<22} {', '.join(names)}{note}")
    return lines


def _mib(n: int) -> str:
    return f"{n // 1024} GiB" if n and n % 1024 == 0 else f"{n} MiB"


def _device(profile: Profile) -> tuple[str, str]:
    """(device, dtype) this machine will use; an absent CUDA index is a profile error."""
    import torch

    from ninfer.engine.builder import DTYPES, resolve_device, resolve_dtype

    device = resolve_device(profile.engine.device)
    if device.type == "cuda" and device.index >= torch.cuda.device_count():
        raise ProfileError([f"engine.device: this machine has {torch.cuda.device_count()} CUDA device(s), "
                            f"got index {device.index}"])
    names = {torch_dtype: name for name, torch_dtype in DTYPES.items()}
    return str(device), names[resolve_dtype(profile.dtype, device)]


def _graph_mode(cuda_graph: bool, device: str) -> str:
    if device == "cpu":
        return "eager (CPU)"
    # whether the family can be captured is only known once it is loaded; the builder says
    return "CUDA graphs where the model allows" if cuda_graph else "eager (--no-cuda-graph)"


def _weight_format(profile: Profile, registry: PluginRegistry) -> str:
    """The checkpoint's weight format, read from its files (a weight_format plugin's name for it)."""
    from ninfer.model.sources import checkpoint_path
    from ninfer.model.weight_format import describe

    path = checkpoint_path(profile.model)
    if path is None:  # random:SHAPE[@QUANT] (random_weights.quant_of would import torch: --check must not)
        quant = profile.model.partition("@")[2]
        return f"random, built in device memory, {f'quantized as {quant}' if quant else 'unquantized'}"
    return describe(registry, path)


def _log_summary(profile: Profile, registry: PluginRegistry, device: str, dtype: str, weights: str) -> None:
    e, c, s = profile.engine, profile.cache, profile.speculative
    # the checkpoint's id and an auto-sized pool are known once loaded (server.run.build_state logs them)
    served = f"served as {profile.model_id}" if profile.model_id else "served as its checkpoint's id"
    logger.info(f"ninfer {__version__}: model {profile.model}, {served}, "
                f"dtype {dtype}, device {device}, weights {weights}")
    pool = f"{e.kv_capacity} tokens" if e.kv_capacity != "auto" else f"auto ({auto_pool(e, device)})"
    logger.info(f"engine: context {e.max_context} tokens, KV pool {pool} as {e.kv_dtype} "
                f"(block {e.block_size}), concurrency {e.max_concurrency} + {profile.server.max_pending_requests} "
                f"pending, prefill chunk {e.prefill_chunk}, decode {_graph_mode(e.cuda_graph, device)}")
    if e.prefix_reuse:
        logger.info(f"context cache: prefix reuse on, host KV tier up to {_mib(c.host_kv_mib or 0)}; recurrent-state "
                    f"snapshots (hybrid families) in {c.device_state_slots} device + {c.host_state_slots} host rows")
        logger.info(f"context cache: up to {c.max_private_continuations} private continuations, "
                    f"{c.max_shared_prefixes} shared prefixes, {c.max_long_anchors_per_continuation} long anchors "
                    "per continuation")
    else:
        logger.info("context cache: off (no prefix reuse)")
    spec = "off" if s.backend is None else (
        f"{s.backend}, {s.draft_tokens} draft tokens" + (", LM-head draft" if s.lm_head_draft else ""))
    logger.info(f"speculative decoding: {spec}")
    protocols = profile.server.protocols or registry.names("protocol")
    kv_plugin = registry.items["kv_dtype"][e.kv_dtype].plugin
    logger.info(f"plugins: kv_dtype {e.kv_dtype} ({kv_plugin}), protocols {', '.join(protocols) or 'none'}, "
                f"reasoning parser {profile.reasoning.parser or 'family default'}, "
                f"tool parser {profile.tools.parser or 'family default'}")
    logger.debug("resolved profile:\n" + to_yaml(profile))


def _serve(profile: Profile, warnings: list[str]) -> int:
    from ninfer.log import setup_logging

    setup_logging(profile.logging.level)
    try:
        registry = _registry(profile)
    except Exception as e:  # a broken third-party plugin must not look like a usage error
        logger.error(f"cannot load plugins: {type(e).__name__}: {e}")
        return 1
    errors = model_errors(profile, registry) + check_selections(profile, registry)
    if not errors:
        try:
            device, dtype = _device(profile)
            weights = _weight_format(profile, registry)
        except ProfileError as e:
            errors = e.errors
        except ValueError as e:  # a checkpoint in a weight format nobody reads
            errors = [f"model: {e}"]
    if errors:
        _report(errors)
        return USAGE_ERROR
    _log_summary(profile, registry, device, dtype, weights)
    for warning in warnings:
        logger.warning(warning)
    try:
        from ninfer.server import run
    except ModuleNotFoundError as e:
        if e.name != "ninfer.server":
            raise
        logger.error("the HTTP server is not available in this build (no ninfer.server module)")
        return 1
    run(profile, registry)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        given = load_profile(args.profile, args.model, overrides_from_args(args))
    except ProfileError as e:
        _report(e.errors)
        return USAGE_ERROR
    profile = resolve(given)
    warnings = not_honoured(given) + capacity_warnings(profile)
    if not (args.check or args.list_plugins):
        return _serve(profile, warnings)
    try:
        registry = _registry(profile)
    except Exception as e:  # see _serve
        _report([f"cannot load plugins: {type(e).__name__}: {e}"])
        return 1
    if args.list_plugins:
        print(registry.describe())
        print("\n".join(_selected(profile, registry)))
    if args.check:
        # --check answers "would this start here?": the plugin choices fail it as they fail startup
        errors = model_errors(profile, registry) + check_selections(profile, registry)
        try:
            weights = _weight_format(profile, registry)
        except ValueError as e:  # a checkpoint in a weight format nobody reads
            errors.append(f"model: {e}")
        if errors:
            _report(errors)
            return USAGE_ERROR
        _report(warnings, "warning")
        print(f"# weights: {weights}")  # read from the checkpoint; a YAML comment, so the output stays a profile
        print(to_yaml(profile), end="")
    return 0
