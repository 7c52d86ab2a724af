"""``ninfer-make-tiny OUT_DIR --family FAMILY [--seed N] [--shards N] [--quant FORMAT]``: write a tiny checkpoint."""

from __future__ import annotations

import argparse
from pathlib import Path

from ninfer.plugins import load_registry
from ninfer.tiny.make import make_tiny, tiny_quant_writers


def main(argv: list[str] | None = None) -> None:
    registry = load_registry()
    families = [f.name for f in registry.all("model_family") if f.tiny_config is not None]
    parser = argparse.ArgumentParser(
        prog="ninfer-make-tiny",
        description="Write a small random Hugging Face checkpoint (weights, config, tokenizer, chat template).",
    )
    parser.add_argument("out_dir", type=Path, metavar="OUT_DIR")
    parser.add_argument("--family", required=True, choices=families, help="model family to write")
    parser.add_argument("--seed", type=int, default=0, help="random seed; the same seed gives identical files")
    parser.add_argument("--shards", type=int, default=1, help="split the weights over this many safetensors files")
    parser.add_argument("--quant", choices=sorted(tiny_quant_writers(registry)), default=None,
                        help="write the weights quantized, in this published checkpoint layout")
    args = parser.parse_args(argv)
    if args.shards < 1:
        parser.error("--shards must be at least 1")
    print(make_tiny(args.out_dir, args.family, seed=args.seed, registry=registry, shards=args.shards,
                    quant=args.quant))


if __name__ == "__main__":
    main()
