"""``ninfer-bench``: throughput figures as JSON lines, ours beside transformers'.

Examples: ``ninfer-bench tiny:qwen3 --device cpu --num-requests 32`` (CPU, the tiny
model); ``ninfer-bench --suite gpu`` (on CUDA: copy bandwidth, decode at concurrency 1,
8, 32 and 64 with bandwidth utilisation, and 2k/8k prefill on a Qwen3-8B-shaped random
checkpoint, transformers dynamic and static+compiled beside us; then nano-vllm's
offline setup on a Qwen3-0.6B shape); ``ninfer-bench tiny:qwen3 --device cpu --workload agent``
(multi-turn coding-agent conversations, with and without prefix reuse:
:mod:`ninfer.bench.agent`). ``random:SHAPE`` models get random weights built
in device memory (:mod:`ninfer.model.random_weights`); no weight file is written.
The figures go to stdout; the engine's log (loading, memory ledger, graph capture) goes
to stderr at INFO, so a long load of a full-size shape shows where it is.
"""

from __future__ import annotations

import argparse
import json
import sys

#: ``--suite gpu``: the issue's figure set in one run
GPU_SUITE = dict(
    model="random:qwen3-8b", only="bandwidth,decode,prefill,offline", concurrency="1,8,32,64",
    hf_dynamic="1,8,32,64", hf_compiled="1,8", prefill_lens="2048,8192", offline_model="random:qwen3-0.6b",
    num_requests=256, input_len=(100, 1024), output_len=(100, 1024), max_concurrency=256, prefill_chunk=8192,
    no_hf_offline=True,
)


def _range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(",")
    return int(lo), int(hi or lo)


def _dtype(text: str) -> str:
    """bf16 and vLLM's spellings of it (bfloat16), as the profile accepts them."""
    from ninfer.profile.schema import canonical_dtype

    try:
        return canonical_dtype(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _ints(text: str) -> list[int]:
    return [int(c) for c in text.split(",") if c]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="ninfer-bench", description=__doc__)
    p.add_argument("model", nargs="?", default="tiny:qwen3", help="checkpoint dir, tiny:FAMILY, or random:SHAPE "
                   "(random weights in device memory; shapes: qwen3-0.6b, qwen3-8b, qwen3-30b-a3b, qwen3.6-27b, "
                   "qwen3.6-35b-a3b); default tiny:qwen3")
    p.add_argument("--suite", choices=["gpu"], help="preset figure set (see above); explicit flags still apply")
    p.add_argument("--device", default="0", help="CUDA index, cuda or cpu (CPU when CUDA is absent)")
    p.add_argument("--dtype", default="auto", type=_dtype, help="auto, bf16, fp16 or fp32 (or vLLM's names)")
    p.add_argument("--kv-dtype", default="bf16", help="KV-cache format of our engine: bf16, int8, fp8, nvfp4, k8v4 "
                   "(docs/kv-formats.md)")
    p.add_argument("--only", default="offline,decode", help="figures: bandwidth, decode, prefill, offline, guided, "
                   "spec_cost")
    p.add_argument("--num-requests", type=int, default=64, help="offline run: number of requests")
    p.add_argument("--input-len", type=_range, default=(100, 1024), help="offline prompt lengths LO,HI (uniform)")
    p.add_argument("--output-len", type=_range, default=(100, 1024), help="offline output lengths LO,HI (uniform)")
    p.add_argument("--offline-model", help="run the offline figure on this model instead (loaded afterwards)")
    p.add_argument("--concurrency", default="1,8", help="decode runs: comma-separated concurrency levels")
    p.add_argument("--decode-prompt-len", type=_ints, default=[512], help="decode runs: prompt lengths "
                   "(comma-separated; every one at every --concurrency; other figures take the longest)")
    p.add_argument("--synthetic-context", action="store_true",
                   help="decode runs: take each prompt but its last token as already computed, without a "
                        "prefill (its KV holds whatever the pool held): decode speed at long contexts in seconds")
    p.add_argument("--decode-output-len", type=int, default=256)
    p.add_argument("--prefill-lens", default="2048,8192", help="prefill runs: prompt lengths")
    p.add_argument("--max-concurrency", type=int, default=8, help="engine admission limit for the offline run")
    p.add_argument("--prefill-chunk", type=int, default=1024)
    p.add_argument("--no-cuda-graph", action="store_true", help="decode eagerly")
    p.add_argument("--decode-ahead", choices=["on", "off", "both"], default="on",
                   help="queue each decode step before the previous one's tokens reach the host (CUDA); "
                        "both: measure decode either way")
    p.add_argument("--sampling", choices=["greedy", "presets"], default="greedy",
                   help="decode runs: plain greedy (every engine decodes the same argmax chain), or the "
                        "family's sampler presets as a request naming no settings gets (Qwen3.5's top-k, top-p, "
                        "presence penalty)")
    p.add_argument("--hf-batch", type=int, default=16, help="transformers offline batch size")
    p.add_argument("--hf-dynamic", help="transformers dynamic-cache decode levels (default: --concurrency)")
    p.add_argument("--hf-compiled", default="", help="transformers static-cache + compile decode levels")
    p.add_argument("--hf-decode-output-len", type=int, help="transformers decode runs: output tokens "
                   "(default: --decode-output-len; fewer keep slow baselines short)")
    p.add_argument("--no-transformers", action="store_true", help="skip the transformers baselines")
    p.add_argument("--no-hf-offline", action="store_true", help="skip transformers in the offline figure only")
    p.add_argument("--guided", help="also the guided-decoding overhead figure for these guides (comma-separated: "
                   "json_schema, json_object, regex, ebnf) at each --concurrency level")
    p.add_argument("--spec", help="speculative backend (mtp, ngram): adds the spec_decode figure (decode without "
                   "speculation, then with each --draft-tokens) and, with --only spec_cost, the round cost")
    p.add_argument("--draft-tokens", default="3", help="draft counts for --spec (comma-separated; the round cost "
                   "uses the first)")
    p.add_argument("--spec-context", type=_ints, default=[32768], help="spec_cost: context lengths of the timed "
                   "sequence (comma-separated)")
    p.add_argument("--spec-acceptance", default="0.8,0.65,0.55,0.45,0.4",
                   help="spec_cost: the acceptance the implied speedup assumes: each draft's rate given the ones "
                        "before it were kept (comma-separated), or a ninfer-train train_report.json (its replay "
                        "of an engine's rounds)")
    p.add_argument("--spec-prompts", help="spec_decode: a text file whose tokens make the prompts (random ids "
                   "otherwise, which a trained model drafts badly)")
    p.add_argument("--lm-head-draft", type=int, metavar="N", default=None,
                   help="--spec drafts score the N most frequent vocabulary entries only (the serve flag's "
                        "shortlist, lm_head_shortlist.json beside the checkpoint; random: shapes have one in id "
                        "order); verification keeps the full head")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workload", choices=["random", "agent"], default="random",
                   help="agent: multi-turn tool-using conversations (shaped like the Claude Code and Codex "
                        "fixtures) with and without prefix reuse, instead of the --only figures")
    g = p.add_argument_group("agent workload")
    g.add_argument("--agents", type=int, default=4, help="conversations running at once (the engine's concurrency)")
    g.add_argument("--turns", type=int, default=10, help="requests per conversation")
    g.add_argument("--agent-prefix-tokens", type=int, default=4000,
                   help="shared system prompt and tools, cut to about this many tokens (0: the fixture's whole)")
    g.add_argument("--agent-result-words", type=int, default=40, help="words in each tool result")
    g.add_argument("--agent-output-tokens", type=int, default=16, help="tokens generated per turn")
    g.add_argument("--agent-over-capacity", type=int, default=0,
                   help="conversations in the run that exceeds the KV pool (default: 4 x --agents)")
    g.add_argument("--agent-host-kv-mib", type=int, default=0, help="host KV tier for the agent runs, MiB")
    g.add_argument("--agent-fixtures", help="directory of the client fixtures (default: shared/fixtures beside "
                   "the checkout, else /work/shared/fixtures; stand-in text when absent)")
    if p.parse_known_args(argv)[0].suite == "gpu":
        p.set_defaults(**GPU_SUITE)  # explicit flags still win
    args = p.parse_args(argv)
    from ninfer.bench.spec_cost import acceptance_arg

    try:  # (rates, where they came from)
        args.spec_acceptance = acceptance_arg(args.spec_acceptance)
    except (ValueError, KeyError, TypeError) as exc:
        p.error(f"--spec-acceptance {args.spec_acceptance!r}: {exc!r}")
    if args.hf_dynamic is None:
        args.hf_dynamic = args.concurrency
    args.decode_prompt_lens, args.decode_prompt_len = args.decode_prompt_len, max(args.decode_prompt_len)
    return args


def emit(record: dict) -> None:
    print(json.dumps(record), flush=True)


def main(argv=None) -> int:
    args = parse_args(argv)
    from ninfer.bench.figures import Bench
    from ninfer.log import setup_logging

    setup_logging("info")
    only = set(args.only.split(",")) | ({"guided"} if args.guided else set())
    if args.workload == "agent":
        from ninfer.bench.agent import agent_workload

        agent_workload(args, emit)
        return 0
    bench = Bench(args, emit)
    levels, lens = _ints(args.concurrency), _ints(args.prefill_lens)
    offline_here = "offline" in only and not args.offline_model
    if only & {"bandwidth", "decode", "prefill", "guided"} or offline_here:
        bench.load(args.model, levels if only & {"decode", "guided"} else [], lens if "prefill" in only else [],
                   offline=offline_here)
        if "bandwidth" in only:
            bench.bandwidth()
        if "decode" in only:
            bench.decode(levels)
        if "prefill" in only:
            bench.prefill(lens)
        if "guided" in only:
            from ninfer.bench.guided import guided_overhead

            for record in guided_overhead(bench.llm.engine, bench.llm.get_tokenizer(),
                                          (args.guided or "json_schema").split(","), levels,
                                          args.decode_prompt_len, args.decode_output_len, args.seed):
                emit({**record, **bench.common})
        if offline_here:
            bench.offline()
        hf_offline = offline_here and not args.no_hf_offline
        if not args.no_transformers and (only & {"decode", "prefill"} or hf_offline):
            decode = "decode" in only
            bench.baseline(args.model, [c for c in levels if decode and c in _ints(args.hf_dynamic)],
                           [c for c in levels if decode and c in _ints(args.hf_compiled)],
                           lens if "prefill" in only else [], hf_offline)
    if args.spec and "spec_cost" in only:
        bench.load(args.model, [1], [], offline=False, draft_tokens=_ints(args.draft_tokens)[0])
        bench.spec_cost(*args.spec_acceptance)
    if args.spec and "decode" in only:
        bench.spec_decode(args.model, levels, _ints(args.draft_tokens))
    if "offline" in only and args.offline_model:
        bench.load(args.offline_model, [], [], offline=True)
        bench.offline()
        if not (args.no_transformers or args.no_hf_offline):
            bench.baseline(args.offline_model, [], [], [], offline=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
