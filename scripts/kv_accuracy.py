"""The accuracy of each KV format on a model against its full-precision KV (docs/kv-formats.md).

    python scripts/kv_accuracy.py /tmp/stdlib-model --heldout heldout.txt --device cpu --dtype fp32

Teacher forced over windows of held-out text: logits cosine, KL and perplexity per format
against the model-dtype cache; then greedy continuations of held-out prompts and their
agreement with the full-precision run. One JSON line per format (ninfer.bench.kv_accuracy).
"""

from __future__ import annotations

import argparse
import json

import torch

from ninfer import LLM, SamplingParams
from ninfer.bench.kv_accuracy import (
    compare_logits, engine_settings, fp8_scale_granularity, greedy_agreement, teacher_forced_logits,
)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("--heldout", required=True, help="a text file of held-out text")
    p.add_argument("--formats", default="int8,fp8,k8v4,nvfp4")
    p.add_argument("--windows", type=int, default=8, help="teacher-forced windows")
    p.add_argument("--length", type=int, default=512, help="tokens per window")
    p.add_argument("--prompts", type=int, default=8, help="greedy prompts")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="fp32")
    a = p.parse_args()
    settings = engine_settings(a.device, a.dtype, a.prompts, a.length, a.prompt_len, a.new_tokens)
    text = open(a.heldout, encoding="utf-8", errors="replace").read()
    runs = {}
    for fmt in ["bf16", *a.formats.split(",")]:
        llm = LLM(a.model, kv_dtype=fmt, **settings)
        ids = llm.get_tokenizer().encode(text)
        step = max(1, (len(ids) - a.length) // a.windows)
        windows = [ids[i * step : i * step + a.length] for i in range(a.windows)]
        logits = [teacher_forced_logits(llm, w) for w in windows]
        if fmt == "bf16":  # the last window's keys and values are still in the native cache
            print(json.dumps({"figure": "fp8_scale_granularity", **fp8_scale_granularity(llm, a.length)}))
        prompts = [ids[i * step + a.length // 2 : i * step + a.length // 2 + a.prompt_len] for i in range(a.prompts)]
        params = SamplingParams(temperature=0, max_tokens=a.new_tokens, ignore_eos=True)
        greedy = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": t} for t in prompts], params)]
        per_token = llm.engine.kv_bytes / llm.engine.num_blocks / llm.engine.config.block_size
        runs[fmt] = (windows, logits, greedy, per_token)
        del llm
    windows, base_logits, base_greedy, _ = runs["bf16"]
    for fmt, (_, logits, greedy, per_token) in runs.items():
        targets = torch.cat([torch.tensor(w[1:]) for w in windows])
        ref = torch.cat([l[:-1] for l in base_logits])
        got = torch.cat([l[:-1] for l in logits])
        record = {"kv_dtype": fmt, "model": a.model, "bytes_per_token": per_token,
                  "tokens_per_gib": (1 << 30) / per_token, **compare_logits(ref, got, targets),
                  **greedy_agreement(base_greedy, greedy)}
        record["perplexity_delta"] = record["perplexity"] / record["perplexity_reference"] - 1
        print(json.dumps(record))


if __name__ == "__main__":
    main()
