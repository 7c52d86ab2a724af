"""``ninfer-train OUT_DIR [--preset NAME] [--seed N]``: train a small qwen3_5 model with its MTP layer.

The corpus is the running Python's standard library; the result is a Hugging Face
checkpoint directory (docs/training.md) plus ``lm_head_shortlist.json`` and
``train_report.json``. The report's main figures are also printed as one JSON object.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import attrs

from ninfer.log import setup_logging
from ninfer.train.presets import PRESETS

#: the report fields printed at the end
SUMMARY = ("preset", "steps", "train_seconds", "total_seconds", "perplexity", "acceptance_per_position",
           "mean_accepted_length", "acceptance_rate", "round_acceptance_per_position", "tokens_per_round",
           "teacher_forced_agreement")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ninfer-train",
        description="Train a small Qwen3.5-family model (Gated DeltaNet hybrid with an MTP layer) on the Python "
        "standard library's source and write it as a Hugging Face checkpoint directory.",
    )
    parser.add_argument("out_dir", type=Path, metavar="OUT_DIR")
    parser.add_argument("--preset", default="default", choices=sorted(PRESETS),
                        help="default: under 3 minutes on 2 CPU cores; test: seconds; gpu: ~113M parameters; "
                             "gpu-deep: ~122M in 32 layers (speculative decoding at a realistic depth)")
    parser.add_argument("--seed", type=int, default=0, help="the same seed gives the same weights (same machine)")
    parser.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda")
    parser.add_argument("--steps", type=int, metavar="N",
                        help="optimisation steps instead of the preset's (the schedule stretches to match)")
    parser.add_argument("--train-seconds", type=float, metavar="S",
                        help="cap the training loop at about S seconds: the run times its first steps and takes "
                             "as many of the preset's steps as fit (the result then depends on the machine)")
    parser.add_argument("--stdlib", type=Path, metavar="DIR",
                        help="the standard-library tree to train on (default: this Python's). A distribution "
                             "may strip the test suites the gpu presets count on; scripts/stdlib_corpus.sh packs "
                             "a whole one to carry there")
    parser.add_argument("--threads", type=int, help="torch CPU threads (results depend on it)")
    parser.add_argument("-q", "--quiet", action="store_true", help="only warnings and errors in the log")
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.steps is not None and args.steps < 1:
        parser.error("--steps must be at least 1")
    if args.stdlib is not None and not args.stdlib.is_dir():
        parser.error(f"--stdlib {args.stdlib}: not a directory")
    setup_logging("warning" if args.quiet else "info")
    import torch

    from ninfer.train.pipeline import run_training

    if args.threads:
        torch.set_num_threads(args.threads)
    preset = PRESETS[args.preset]
    if args.steps is not None:
        preset = attrs.evolve(preset, steps=args.steps)
    report = run_training(args.out_dir, preset, seed=args.seed, device=args.device,
                          train_seconds=args.train_seconds, stdlib=args.stdlib)
    print(json.dumps({key: report[key] for key in SUMMARY}))


if __name__ == "__main__":
    main()
