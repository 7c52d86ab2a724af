"""The same workloads through Hugging Face transformers ``generate`` (the baseline).

Two setups: ``dynamic`` is plain ``generate`` (dynamic KV cache, eager); ``compiled``
uses a static cache with transformers' automatic ``torch.compile`` of the decode step,
warmed by one untimed run of identical shapes so compilation is not timed.
"""

from __future__ import annotations

import time

import torch

from ninfer.bench.workload import Workload

SETUPS = ("dynamic", "compiled")


def load_hf(model_dir: str, dtype: torch.dtype, device: torch.device):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device)
    model.eval()
    return model


def _setup_kwargs(setup: str) -> dict:
    if setup == "dynamic":
        return {}
    from transformers import CompileConfig

    return {"cache_implementation": "static", "compile_config": CompileConfig(fullgraph=True)}


def _generate(model, prompts: list[list[int]], new_tokens: int, device, setup: str = "dynamic") -> float:
    """Left-padded batch, EOS ignored (min_new_tokens); returns seconds."""
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    ids, mask = ids.to(device), mask.to(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    with torch.no_grad():
        model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                       do_sample=False, pad_token_id=0, **_setup_kwargs(setup))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def offline_throughput(model, work: Workload, batch: int, device) -> dict:
    """Requests in fixed batches; only each request's own output tokens count."""
    seconds = 0.0
    for i in range(0, len(work.prompts), batch):
        prompts = work.prompts[i : i + batch]
        seconds += _generate(model, prompts, max(work.output_lens[i : i + batch]), device)
    return {"output_tokens": work.output_tokens, "seconds": seconds, "output_tok_s": work.output_tokens / seconds}


def decode_throughput(model, work: Workload, device, setup: str = "dynamic") -> dict:
    """Whole-batch generate minus a one-token generate (the prefill) over the rest."""
    new = work.output_lens[0]
    # untimed first: the compiled setup compiles and captures on identical shapes; the
    # dynamic one still JIT-compiles (and autotunes, for flash-linear-attention) its kernels
    _generate(model, work.prompts, new if setup == "compiled" else 2, device, setup)
    total = _generate(model, work.prompts, new, device, setup)
    prefill = _generate(model, work.prompts, 1, device, setup)
    tokens = len(work.prompts) * (new - 1)
    seconds = max(total - prefill, 1e-9)
    return {"decode_tokens": tokens, "seconds": seconds, "decode_tok_s": tokens / seconds, "setup": setup}
