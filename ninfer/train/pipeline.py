"""One training run end to end: corpus, tokenizer, training, evaluation, checkpoint, report."""

from __future__ import annotations

import json
import platform
import time
from pathlib import Path
from typing import Any

import torch
from loguru import logger

from ninfer.train.checkpoint import checkpoint_tensors, hf_config, write_checkpoint
from ninfer.train.corpus import Corpus, load_corpus
from ninfer.train.loop import train
from ninfer.train.model import TrainModel
from ninfer.train.presets import PRESETS, Preset
from ninfer.train.report import evaluate
from ninfer.engine.spec.shortlist import build_shortlist, write_shortlist
from ninfer.train.tokenizer import control_token_ids, encode_documents, fit_tokenizer, write_tokenizer
from ninfer_plugins.models.hybrid_config import HybridConfig

REPORT_FILE = "train_report.json"


def build_model(config: dict[str, Any], preset: Preset, seed: int, device: torch.device,
                positions: int | None = None) -> TrainModel:
    """The trainable model for ``config``, seeded; its rotary table covers the preset's
    lengths, or ``positions``."""
    if positions is None:
        positions = max(preset.seq_len, preset.eval_prompt_len + preset.eval_new_tokens) + preset.mtp_depth + 1
    with torch.random.fork_rng(devices=[]):  # the caller's global generator stays as it was
        torch.manual_seed(seed)
        model = TrainModel(HybridConfig.from_hf(config), positions)
    return model.to(device)


def load_trained(path: Path, preset: Preset, device: str | torch.device = "cpu",
                 positions: int | None = None) -> TrainModel:
    """The trainer's model with the weights of checkpoint ``path`` (one ``ninfer-train``
    wrote, or any in that released layout: the vision tower is left out), in eval mode.
    ``positions``: a rotary table longer than the preset's, for longer sequences."""
    from safetensors.torch import load_file

    from ninfer.train.checkpoint import VISION_PREFIX

    config = json.loads((Path(path) / "config.json").read_text())
    model = build_model(config, preset, 0, torch.device(device), positions)
    weights = {}
    for file in sorted(Path(path).glob("*.safetensors")):
        weights.update(load_file(str(file), device=str(device)))
    model.load_state_dict({n: t for n, t in weights.items() if not n.startswith(VISION_PREFIX)})
    return model.eval()


def trained_corpus(model_dir: Path, heldout_bytes: int | None = None) -> Corpus:
    """The held-out side of the corpus a ``ninfer-train`` checkpoint was trained on: the
    standard-library tree its report names (``--stdlib``; this Python's when that is gone or
    unnamed), test suites in or out and ``heldout_bytes`` (default: as many as its report
    evaluated) as its preset had them. Scripts that sample held-out prompts for a trained
    model read them here, so their windows spread over the report's text."""
    report_file = Path(model_dir) / REPORT_FILE
    report = json.loads(report_file.read_text(encoding="utf-8")) if report_file.is_file() else {}
    named = report.get("stdlib")
    root = Path(named) if named and Path(named).is_dir() else None
    if named and root is None:
        logger.warning("{} was trained on the standard library at {}, which is not here: held-out prompts come "
                       "from this Python's instead (another split)", model_dir, named)
    preset = PRESETS.get(report.get("preset", ""))
    if heldout_bytes is None:
        heldout_bytes = preset.heldout_bytes if preset else 100_000
    return load_corpus(1, heldout_bytes, preset.include_tests if preset else False, root=root)


def run_training(
    out_dir: Path, preset: Preset, seed: int = 0, device: str | torch.device = "cpu",
    train_seconds: float | None = None, stdlib: Path | None = None,
) -> dict[str, Any]:
    """Train ``preset`` and write the checkpoint, shortlist and report into ``out_dir``; returns the report.

    ``train_seconds`` caps the optimisation loop's time (fewer steps, same schedule shape);
    ``stdlib`` reads another standard-library tree than this Python's (the report records it)."""
    start = time.perf_counter()
    device = torch.device(device)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    corpus = load_corpus(preset.train_bytes, preset.heldout_bytes, preset.include_tests, root=stdlib)
    tok = fit_tokenizer(corpus.train_texts, preset.vocab_size)
    train_stream = torch.tensor(encode_documents(tok, corpus.train_texts))
    heldout_stream = torch.tensor(encode_documents(tok, corpus.heldout_texts))
    logger.info("corpus: {} train files ({} tokens), {} held-out files ({} tokens) from {}", len(corpus.train_files),
                len(train_stream), len(corpus.heldout_files), len(heldout_stream), corpus.root)
    ids = write_tokenizer(out_dir, tok)
    config = hf_config(preset, ids)
    model = build_model(config, preset, seed, device)
    mtp_params = sum(p.numel() for p in model.mtp.parameters())
    total_params = sum(p.numel() for p in model.parameters())
    logger.info("model: {:.2f}M parameters ({:.2f}M in the MTP layer), preset {}", total_params / 1e6,
                mtp_params / 1e6, preset.name)
    prepared = time.perf_counter()
    training = train(model, train_stream, preset, seed, device, max_seconds=train_seconds)
    evaluating = time.perf_counter()
    figures = evaluate(model, heldout_stream, preset, device)
    evaluated = time.perf_counter()
    write_checkpoint(out_dir, config, ids, checkpoint_tensors(config, model.state_dict(), seed))
    shortlist = build_shortlist(train_stream, ids["vocab_size"], control_token_ids(tok), config["vocab_size"])
    write_shortlist(out_dir, shortlist)
    report = {
        "preset": preset.name,
        "seed": seed,
        "device": str(device),
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "stdlib": corpus.root,
        "train_files": len(corpus.train_files),
        "heldout_files": len(corpus.heldout_files),
        "train_tokens": len(train_stream),
        "tokens_seen": training["steps"] * preset.batch_size * preset.seq_len,
        "parameters": total_params,
        "mtp_parameters": mtp_params,
        **training,
        **figures,
        "prepare_seconds": prepared - start,  # corpus, tokenizer, model
        "evaluate_seconds": evaluated - evaluating,
        "total_seconds": time.perf_counter() - start,
    }
    (out_dir / REPORT_FILE).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    logger.info("held-out perplexity {:.2f}; MTP acceptance per position {} at every base (mean accepted "
                "length {:.2f} of {}), {} over the rounds an engine runs ({:.2f} tokens a round)",
                report["perplexity"], " ".join(f"{r:.3f}" for r in report["acceptance_per_position"]),
                report["mean_accepted_length"], preset.mtp_depth,
                " ".join(f"{r:.3f}" for r in report["round_acceptance_per_position"]), report["tokens_per_round"])
    return report
