"""What each quantized weight layout costs a model in accuracy (docs/weight-formats.md).

    python scripts/weight_accuracy.py /tmp/stdlib-model --heldout heldout.txt --dtype fp32

Writes the checkpoint in each ``ninfer-make-tiny --quant`` layout (the same writers, on
the model's own weights: round to nearest, no calibration), loads it as a user would, and
compares it with the original checkpoint, teacher forced over windows of held-out text
(logit cosine, KL, perplexity) and by greedy agreement, with the KV-format study's
helpers (ninfer.bench.kv_accuracy). One JSON line per layout.

``--fp8-activations`` also quantizes x per token per 128 columns before every FP8
product, as the CUDA kernels' tensor-core path does (the CPU reference multiplies in the
activation dtype): what FP8 costs with that path in use.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

import torch

from ninfer import LLM, SamplingParams
from ninfer.bench.kv_accuracy import compare_logits, engine_settings, greedy_agreement, teacher_forced_logits
from ninfer.model.loader import iter_weights, read_config
from ninfer.plugins import load_registry
from ninfer.tiny.make import _write_json, tiny_quant_writers, write_weights

LAYOUTS = "fp8-block,ct-fp8,ct-w4a16,ct-nvfp4,modelopt-nvfp4,awq,gptq"


def quantized_copy(model: Path, layout: str, out: Path, writers) -> Path:
    """``model``'s checkpoint rewritten in ``layout``; tokenizer and other files copied."""
    shutil.copytree(model, out, ignore=shutil.ignore_patterns("*.safetensors", "*.safetensors.index.json"))
    config = read_config(model)
    result = writers[layout](config, dict(iter_weights(model)))
    _write_json(out / "config.json", {**config, **result.config})
    for name, content in result.files.items():
        _write_json(out / name, content)
    write_weights(out, {n: t.contiguous() for n, t in result.tensors.items()})
    return out


def fp8_activations() -> None:
    """Make the reference ``quant_linear`` quantize x as the FP8 tensor-core kernels do."""
    from ninfer_kernels import ops
    from ninfer_kernels import quant_formats as qf
    from ninfer_kernels.triton.quant_tiles import quantize_activations_reference

    plain = ops.IMPLEMENTATIONS["quant_linear"]["reference"]

    def with_quantized_x(x, weight, bias=None):
        if not isinstance(weight, qf.Fp8Block):
            return plain(x, weight, bias)
        flat = x.reshape(-1, x.shape[-1])
        q, s = quantize_activations_reference(flat)
        xq = (q.float() * s.repeat_interleave(128, dim=1)[:, :flat.shape[1]]).to(x.dtype)
        return plain(xq.reshape(x.shape), weight, bias)

    ops.IMPLEMENTATIONS["quant_linear"]["reference"] = with_quantized_x


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model", type=Path)
    p.add_argument("--heldout", required=True)
    p.add_argument("--layouts", default=LAYOUTS)
    p.add_argument("--windows", type=int, default=8)
    p.add_argument("--length", type=int, default=512)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="fp32")
    p.add_argument("--fp8-activations", action="store_true")
    a = p.parse_args()
    if a.fp8_activations:
        fp8_activations()
    writers = tiny_quant_writers(load_registry())
    settings = engine_settings(a.device, a.dtype, a.prompts, a.length, a.prompt_len, a.new_tokens)
    text = open(a.heldout, encoding="utf-8", errors="replace").read()
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for layout in ["original", *a.layouts.split(",")]:
            path = a.model if layout == "original" else quantized_copy(a.model, layout, Path(tmp) / layout, writers)
            llm = LLM(str(path), **settings)
            ids = llm.get_tokenizer().encode(text)
            step = max(1, (len(ids) - a.length) // a.windows)
            windows = [ids[i * step: i * step + a.length] for i in range(a.windows)]
            logits = [teacher_forced_logits(llm, w) for w in windows]
            prompts = [ids[i * step + a.length // 2: i * step + a.length // 2 + a.prompt_len] for i in range(a.prompts)]
            params = SamplingParams(temperature=0, max_tokens=a.new_tokens, ignore_eos=True)
            greedy = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": t} for t in prompts], params)]
            weight_bytes = sum(t.nbytes for t in llm.engine.model.parameters())
            runs[layout] = (windows, logits, greedy, weight_bytes, llm.engine.model.weight_format)
            del llm
    windows, base_logits, base_greedy, _, _ = runs["original"]
    for layout, (_, logits, greedy, weight_bytes, name) in runs.items():
        targets = torch.cat([torch.tensor(w[1:]) for w in windows])
        ref = torch.cat([l[:-1] for l in base_logits])
        got = torch.cat([l[:-1] for l in logits])
        record = {"layout": layout, "weight_format": name, "weight_bytes": weight_bytes,
                  **compare_logits(ref, got, targets), **greedy_agreement(base_greedy, greedy)}
        record["perplexity_delta"] = record["perplexity"] / record["perplexity_reference"] - 1
        print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main()
