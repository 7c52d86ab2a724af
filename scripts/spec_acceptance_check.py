#!/usr/bin/env python3
"""Does the engine accept as many drafts as the trained model's own MTP chain predicts?

Speculative decoding is lossless whatever the drafts, so a drafter that drafts the wrong
thing on one device (a kernel that writes the head's KV to the wrong slot, a position off
by one) only shows as lower acceptance. This script measures acceptance twice on the same
held-out prompts of a checkpoint ``ninfer-train`` wrote:

- ``trainer``: the trainer's model in float32 (``--trainer-device``, the CPU by default)
  continues each prompt greedily, drafts with its MTP chain at every base, and replays
  the rounds a greedy engine would run (each starting after the previous one's kept
  drafts);
- ``engine``: ``LLM(..., spec="mtp")`` on ``--device``/``--dtype`` decodes the same prompts,
  and its interval statistics give the per-position acceptance. Every round's drafts are
  also compared with the trainer's chain at the same base of the engine's own output
  (``drafts_equal_to_trainer``, per position): in float32 on the CPU all of them are;
  bf16 rounding flips a few near-ties, a wrong drafting path many. The engine's greedy
  outputs are compared with the trainer's continuations too (``first_token_equal``,
  ``mean_common_prefix``): a fault in the target's own forward shows there, where a
  drafting fault does not.

``--no-cuda-graph`` runs the engine eagerly and ``NINFER_DEVICE_ROUNDS=0`` keeps its
rounds on the host, so a gap can be pinned on one path (``gpu_session.sh spec-gap``).

On the CPU they agree within a few thousandths (session 32, ``default`` preset: trainer
0.714 / 0.444 / 0.311, engine 0.715 / 0.444 / 0.312 in float32 and 0.737 / 0.474 / 0.304
in bf16), and so they do on an H100 in bf16 (session 34, ``gpu-deep``: trainer 0.395 /
0.202 / 0.091, engine 0.399 / 0.200 / 0.091 with graphs and device rounds, 97-99% of its
drafts the trainer's). A gap of tenths would mean the device's drafting path is wrong
somewhere. One JSON line each, then the gap.

    python3 scripts/spec_acceptance_check.py /tmp/trained --preset gpu-deep --device cuda --dtype bf16 \
        --trainer-device cuda
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch


@torch.no_grad()
def trainer_rounds(model, prompts: torch.Tensor, new_tokens: int, k: int) -> tuple[dict, list[list[int]]]:
    """Per-position acceptance and tokens a round of the greedy rounds the chain implies,
    and the greedy continuations themselves."""
    from ninfer.train.report import chain_drafts, greedy_continue, round_acceptance

    seqs = greedy_continue(model, prompts, new_tokens)
    replay = round_acceptance(chain_drafts(model, seqs, k), seqs, prompts.shape[1])
    return replay, seqs[:, prompts.shape[1]:].tolist()


def _agreement(outputs: list[list[int]], expected: list[list[int]]) -> dict:
    """How far the engine's greedy outputs follow the trainer's: a fault in the target's
    own forward (not the drafting) shows here as early divergence, float32 against float32
    as any divergence at all."""
    prefixes = []
    for out, want in zip(outputs, expected):
        n = 0
        while n < min(len(out), len(want)) and out[n] == want[n]:
            n += 1
        prefixes.append(n / max(len(want), 1))
    return {"first_token_equal": sum(o[:1] == w[:1] for o, w in zip(outputs, expected)) / len(expected),
            "mean_common_prefix": sum(prefixes) / len(prefixes)}


class DraftLog:
    """The drafts every round of one request proposed, by base (the last kept position: its
    drafts are tokens base + 2 ..), from both round paths: the host's proposals and the
    rows device rounds hand back (rounds launched ahead never pass the host's proposer)."""

    def __init__(self):
        from ninfer.engine.spec import device_rounds
        from ninfer_plugins.speculative import mtp

        self.by_base: dict[int, list[int]] = {}
        self._restore = [(device_rounds.DeviceRounds, "run"), (mtp.MtpProposer, "propose")]
        self._saved = [getattr(owner, name) for owner, name in self._restore]
        run, propose, log = self._saved[0], self._saved[1], self

        def logged_run(rounds, bucket, num):
            start = int(rounds.verify.positions.view(-1, rounds.width)[0, 0])
            out, bank = run(rounds, bucket, num)
            row = out[0].tolist()
            log.by_base[start + row[0]] = row[1 + rounds.width:]
            return out, bank

        def logged_propose(proposer, seq, limit):
            drafts = propose(proposer, seq, limit)
            if drafts:
                log.by_base.setdefault(seq.num_tokens - 2, list(drafts))
            return drafts

        device_rounds.DeviceRounds.run, mtp.MtpProposer.propose = logged_run, logged_propose

    def close(self) -> None:
        for (owner, name), saved in zip(self._restore, self._saved):
            setattr(owner, name, saved)


def engine_rounds(path: Path, prompts: list[list[int]], new_tokens: int, k: int, device: str, dtype: str,
                  trainer_model, expected: list[list[int]] | None = None, **engine_options) -> dict:
    """The engine's acceptance on ``prompts``, and how often each of its drafts equals the
    trainer's chain at the same base of the sequence the engine itself produced."""
    from ninfer import LLM, SamplingParams
    from ninfer.train.report import chain_drafts

    longest = max(len(p) for p in prompts) + new_tokens + 2 * k + 8
    llm = LLM(str(path), device=device, dtype=dtype, max_context=longest, max_concurrency=1, spec="mtp",
              draft_tokens=k, **engine_options)
    rounds = "device" if llm.engine.runner.rounds is not None else "host"
    greedy = SamplingParams(temperature=0, presence_penalty=0.0, max_tokens=new_tokens, ignore_eos=True)
    llm.generate([{"prompt_token_ids": prompts[0]}], greedy)  # compiles, captures
    llm.engine.stats.take_interval()
    same, compared, outputs = [0] * k, [0] * k, []
    for prompt in prompts:
        log = DraftLog()
        try:
            out = llm.generate([{"prompt_token_ids": prompt}], greedy)[0].outputs[0].token_ids
        finally:
            log.close()
        outputs.append(list(out))
        on = next(trainer_model.parameters()).device
        chain = chain_drafts(trainer_model, torch.tensor([prompt + list(out)], device=on), k)[0].tolist()
        for base, drafts in log.by_base.items():
            if base >= len(chain):  # the last rounds draft past the sequence's end
                continue
            for j, token in enumerate(drafts):
                compared[j] += 1
                same[j] += token == chain[base][j]
    stats = llm.engine.stats.take_interval()
    return {"position_acceptance": list(stats.position_acceptance), "tokens_per_round": stats.acceptance_length,
            "rounds": stats.rounds, "round_path": rounds,
            "drafts_equal_to_trainer": [s / max(c, 1) for s, c in zip(same, compared)],
            **(_agreement(outputs, expected) if expected else {})}


def main() -> None:
    from tokenizers import Tokenizer

    from ninfer.train.pipeline import trained_corpus
    from ninfer.train.pipeline import load_trained
    from ninfer.train.presets import PRESETS
    from ninfer.train.report import windows

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", type=Path, help="a checkpoint directory ninfer-train wrote")
    ap.add_argument("--preset", default="default", help="the preset it was trained with (its held-out bytes)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="fp32")
    ap.add_argument("--trainer-device", default="cpu", help="where the trainer's model runs (float32 either way)")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=48)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--draft-tokens", type=int, default=3)
    ap.add_argument("--no-cuda-graph", action="store_true",
                    help="the engine drafts and verifies eagerly (on CUDA: tells a captured path's fault apart)")
    ap.add_argument("--decode-ahead-on-cpu", action="store_true",
                    help="on the CPU, run greedy rounds whole as device rounds (the CUDA path's round code)")
    ap.add_argument("--no-trainer", action="store_true", help="the engine's side alone (the trainer's chain still "
                    "scores its drafts)")
    args = ap.parse_args()
    preset = PRESETS[args.preset]
    tokenizer = Tokenizer.from_file(str(args.model / "tokenizer.json"))
    corpus = trained_corpus(args.model)
    stream = torch.tensor(tokenizer.encode("\n".join(corpus.heldout_texts)).ids)
    prompts = windows(stream, args.prompt_len, args.prompts)
    device = torch.device(args.trainer_device)
    model = load_trained(args.model, preset, device, positions=args.prompt_len + args.new_tokens + 8)
    expected = None
    if not args.no_trainer:
        trainer, expected = trainer_rounds(model, prompts.to(device), args.new_tokens, args.draft_tokens)
        print(json.dumps({"side": "trainer", "device": args.trainer_device, "dtype": "fp32", **trainer}), flush=True)
    graphs = not args.no_cuda_graph
    engine = engine_rounds(args.model, prompts.tolist(), args.new_tokens, args.draft_tokens, args.device, args.dtype,
                           model, expected, cuda_graph=graphs, decode_ahead_on_cpu=args.decode_ahead_on_cpu)
    print(json.dumps({"side": "engine", "device": args.device, "dtype": args.dtype,
                      "cuda_graph": graphs and args.device != "cpu",
                      **engine}), flush=True)
    if not args.no_trainer:
        gap = [round(a - b, 3) for a, b in zip(trainer["position_acceptance"], engine["position_acceptance"])]
        print(json.dumps({"trainer_minus_engine": gap}), flush=True)


if __name__ == "__main__":
    main()
