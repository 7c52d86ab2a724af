"""``ninfer-run``: run a batch input file (docs: the input format) through one model.

The model comes from the same profile and flags as ``ninfer-serve``. Everything that can
be checked without the model (flags, profile, the whole input file, the output folder)
is checked first; such problems exit with status 2 and write nothing. Status 1 means the
model could not load, the engine died, or the results could not be written; otherwise
the status is 0 and requests that failed carry their error in the results file.

Unless ``--max-concurrency`` is given, the engine decodes ``batch_size`` requests
together (capped at the profile's limit for that option; the run warns when it caps).
Options the runner never reads (listening, authentication, the response store, tool
parsing, ``--default-max-tokens``, ``--thinking``) have no flag here: given anyway, they
are refused with a pointer to ``ninfer-serve`` rather than accepted and ignored.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any, Optional

from loguru import logger

from ninfer.batch.schema import BatchInput, BatchInputError, parse_batch_json
from ninfer.cli.common import add_model_arguments, add_version_and_profile_flags, report
from ninfer.profile import Profile, ProfileError, check_selections, load_profile, resolve
from ninfer.profile.checks import Bool
from ninfer.profile.flags import overrides_from_args
from ninfer.profile.schema import flag_name, options
from ninfer.sampling_schema import PROCESS_TOP_K_CAP

PROG = "ninfer-run"
USAGE_ERROR = 2
FAILURE = 1
_CONCURRENCY_KEY = "engine.max_concurrency"
#: profile options the runner never reads: the input file sets the output length
#: (max_generate_length) and thinking (enable_thinking), and there is no server or tool call
UNUSED_KEYS = frozenset(
    [key for key, _, _ in options() if key.startswith(("server.", "tools."))]
    + ["engine.default_max_tokens", "reasoning.thinking", "logging.stats_interval_ms", "logging.request_log_jsonl"]
)
_CONCURRENCY_CAP = next(o.parse.hi for key, _, o in options() if key == _CONCURRENCY_KEY)
#: the input format's sampler defaults (ninfer.batch.runner applies them; not imported here,
#: so --help needs no torch)
_FORMAT_SAMPLER_DEFAULTS = {"temperature": "1.0", "top_p": "0.8"}
#: where this command's defaults differ from the server's (model presets do not apply here)
_HELP_TEXTS = {
    _CONCURRENCY_KEY: f"requests decoded together (default: the input's batch_size, at most {_CONCURRENCY_CAP})",
    "model_id": "model name the results' summary reports (default: the checkpoint's own id)",
    **{f"sampling.{name}": f"{name} for requests when the input file sets none (default: {value}, the format's)"
       for name, value in _FORMAT_SAMPLER_DEFAULTS.items()},
    "sampling.top_k": f"top_k for requests when the input file sets none, at most {PROCESS_TOP_K_CAP} "
                      f"(0: {PROCESS_TOP_K_CAP}) (default: 50, the format's)",
    **{f"sampling.{name}": f"{name} for every request (default: {value}, off; model presets do not apply)"
       for name, value in (("min_p", "0"), ("presence_penalty", "0"), ("frequency_penalty", "0"))},
}


class _NotUsedHere(argparse.Action):
    """A flag ninfer-serve takes but this command would ignore: refuse it instead."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: Optional[str] = None) -> None:
        parser.error(f"{option_string} is a ninfer-serve option; {PROG} does not use it")


def _refuse_unused_flags(parser: argparse.ArgumentParser) -> None:
    for key, _, o in options():
        flag = flag_name(key, o)
        if key not in UNUSED_KEYS or flag is None:
            continue
        names = [f"--{flag}"] + ([f"--no-{flag}"] if isinstance(o.parse, Bool) else [])
        parser.add_argument(*names, action=_NotUsedHere, nargs=0 if isinstance(o.parse, Bool) else "*",
                            dest=f"unused.{key}", default=argparse.SUPPRESS, help=argparse.SUPPRESS)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Generate for every request of a batch input JSON file and write the results as JSON.",
        epilog="Profile options work as with ninfer-serve: a flag beats the profile. With "
        "apply_chat_template false, a request's prompt is the text of its messages joined with nothing in "
        "between. Exit status: 0 results written (failed requests carry their error), 1 runtime failure, "
        "2 bad flags, profile or input (nothing written).",
    )
    add_model_arguments(parser)
    parser.add_argument("--input", required=True, metavar="FILE", help="batch input JSON file")
    parser.add_argument("--output", required=True, metavar="FILE",
                        help="results JSON file, replaced in one step when the run ends")
    parser.add_argument("-q", "--quiet", action="store_true",
                        help="no progress bar, and only warnings and errors in the log")
    add_version_and_profile_flags(parser, omit=UNUSED_KEYS, help_texts=_HELP_TEXTS)
    _refuse_unused_flags(parser)
    return parser


def _report(errors: list[str], label: str = "error") -> None:
    report(PROG, errors, label)


def _read_batch(path: str) -> BatchInput:
    try:
        text = Path(path).read_text(encoding="utf-8-sig")  # tolerate a byte-order mark
    except (OSError, UnicodeDecodeError) as e:
        raise BatchInputError([f"--input: cannot read {path}: {getattr(e, 'strerror', None) or e}"]) from None
    return parse_batch_json(text)


def _output_problem(path: Path) -> Optional[str]:
    if path.is_dir():
        return f"--output: {path} is a directory"
    if not path.parent.is_dir():
        return f"--output: folder {path.parent} does not exist"
    return None


def _overrides(args: argparse.Namespace, batch: BatchInput) -> dict[str, Any]:
    overrides = overrides_from_args(args)
    if _CONCURRENCY_KEY not in overrides:  # run_batch warns when this caps batch_size
        overrides[_CONCURRENCY_KEY] = min(batch.batch_size, _CONCURRENCY_CAP)
    if args.model is not None:
        overrides["model"] = args.model
    return overrides


def _check_profile(args: argparse.Namespace, overrides: dict[str, Any]) -> tuple[Optional[Profile], list[str]]:
    """The resolved profile, or every problem with it (plugins this machine lacks included)."""
    if args.profile is not None and not args.profile.endswith((".yaml", ".yml")):
        # ninfer.LLM recognises a profile by its extension
        return None, [f"--profile: {args.profile}: expected a .yaml or .yml file"]
    try:
        profile = resolve(load_profile(args.profile, None, overrides))
    except ProfileError as e:
        return None, e.errors
    from ninfer.plugins import load_registry

    errors = check_selections(profile, load_registry(profile.plugins.allow))
    return (None if errors else profile), errors


def _run(args: argparse.Namespace, batch: BatchInput, overrides: dict[str, Any]) -> int:
    from ninfer import LLM
    from ninfer.batch.output import output_document, write_json_atomic
    from ninfer.batch.runner import run_batch

    started = time.perf_counter()
    try:
        llm = LLM(args.profile, **overrides)
    except Exception as e:  # noqa: BLE001 - any load failure is reported the same way
        logger.opt(exception=e).debug("model load failed")
        _report([f"cannot load the model: {type(e).__name__}: {e}"])
        return FAILURE
    load_seconds = time.perf_counter() - started
    run = run_batch(llm, batch, progress=not args.quiet and sys.stderr.isatty())
    document = output_document(run, batch, llm.loaded.model_id, load_seconds)
    try:
        write_json_atomic(args.output, document)
    except OSError as e:
        _report([f"--output: cannot write {args.output}: {e.strerror or e}"])
        return FAILURE
    s = document["summary"]
    logger.info(f"{s['requests']} requests ({s['failed']} failed), {s['generated_tokens']} tokens generated in "
                f"{s['seconds']:.2f} s ({s['output_tokens_per_second']:.1f} tok/s); results in {args.output}")
    if llm.engine.dead:
        _report([f"the engine failed: {llm.engine.dead}"])
        return FAILURE
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        batch = _read_batch(args.input)
    except BatchInputError as e:
        _report(e.errors)
        return USAGE_ERROR
    problem = _output_problem(Path(args.output))
    if problem:
        _report([problem])
        return USAGE_ERROR
    overrides = _overrides(args, batch)
    try:
        profile, errors = _check_profile(args, overrides)
    except Exception as e:  # noqa: BLE001 - a broken plugin must not look like a usage error
        _report([f"cannot load plugins: {type(e).__name__}: {e}"])
        return FAILURE
    if profile is None or errors:
        _report(errors)
        return USAGE_ERROR
    _report(batch.warnings, "warning")

    from ninfer.log import setup_logging

    quiet_level = "warning" if args.quiet and "logging.level" not in overrides else None
    setup_logging(quiet_level or profile.logging.level)
    try:
        return _run(args, batch, overrides)
    except KeyboardInterrupt:
        _report(["interrupted; no results written"])
        return 130
