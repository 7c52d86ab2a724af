"""What a KV format costs in accuracy: the same model with full-precision and quantized KV.

For held-out text, teacher forced: the logits at every position with each format against
the model-dtype cache (cosine of the logit vectors, KL(p_full || p_format)), and the
perplexity of the text under each. Then greedy continuations of held-out prompts: the
share of positions where a format's tokens equal the full-precision run's.

The teacher-forced pass drives the loaded model directly over the engine's own caches
(one sequence in pages 0.., chunk by chunk, as prefill would), so every key and value it
attends to went through the format's write and is read back through its attention.
It needs an idle engine: nothing else may hold those pages or state slot 0.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from ninfer.model.forward_batch import ForwardBatch
from ninfer_kernels.kv_quant import FP8_MAX


def engine_settings(device: str, dtype: str, prompts: int, window: int, prompt_len: int, new_tokens: int) -> dict:
    """``LLM`` settings for a comparison: no prefix reuse (every run computes every position),
    and a KV pool for all ``prompts`` at once (the default holds one context, so the greedy
    continuations would decode one by one)."""
    context = max(window, prompt_len + new_tokens) + 16
    return dict(device=device, dtype=dtype, prefix_reuse=False, max_concurrency=prompts, max_context=context,
                kv_capacity=prompts * context)


@torch.inference_mode()
def teacher_forced_logits(llm, ids: Sequence[int], chunk: int = 32) -> torch.Tensor:
    """float32 [len(ids), V]: the logits after each prefix of ``ids``."""
    engine = llm.engine
    if engine.has_unfinished():
        raise RuntimeError("the accuracy pass needs an idle engine")
    model, bs, dev = engine.model, engine.config.block_size, engine.device
    n = len(ids)
    pages = -(-n // bs)
    if pages > engine.num_blocks:
        raise ValueError(f"{n} tokens need {pages} KV pages; the pool has {engine.num_blocks}")
    table = torch.arange(pages, dtype=torch.int32, device=dev).unsqueeze(0)
    stateful = engine.scheduler.state_slots is not None
    out = []
    for start in range(0, n, chunk):
        end = min(start + chunk, n)
        rows = end - start
        batch = ForwardBatch(
            query_start=torch.tensor([0, rows], dtype=torch.int32, device=dev),
            seq_lens=torch.tensor([end], dtype=torch.int32, device=dev), block_tables=table,
            slot_mapping=torch.arange(start, end, dtype=torch.int64, device=dev),
            logits_indices=torch.arange(rows, device=dev), block_size=bs, max_query_len=rows, max_seq_len=end,
            query_lens_host=[rows], seq_lens_host=[end],
            state_slots=torch.zeros(1, dtype=torch.int64, device=dev) if stateful else None,
        )
        tokens = torch.tensor(ids[start:end], dtype=torch.int64, device=dev)
        hidden = model(tokens, torch.arange(start, end, device=dev), batch)
        out.append(model.compute_logits(hidden).float().cpu())
    return torch.cat(out)


def compare_logits(reference: torch.Tensor, other: torch.Tensor, targets: torch.Tensor) -> dict:
    """Cosine and KL(reference || other) per position (means), and both perplexities of
    ``targets`` (the next token at each position)."""
    cos = torch.nn.functional.cosine_similarity(reference.double(), other.double(), dim=-1)
    ref_lp, other_lp = reference.double().log_softmax(-1), other.double().log_softmax(-1)
    kl = (ref_lp.exp() * (ref_lp - other_lp)).sum(-1)

    def ppl(lp: torch.Tensor) -> float:
        return math.exp(-lp.gather(1, targets[:, None]).mean().item())

    return {"logits_cosine": cos.mean().item(), "logits_cosine_min": cos.min().item(), "kl_mean": kl.mean().item(),
            "kl_max": kl.max().item(), "perplexity_reference": ppl(ref_lp), "perplexity": ppl(other_lp)}


def greedy_agreement(reference: Sequence[Sequence[int]], other: Sequence[Sequence[int]]) -> dict:
    """Share of positions with the same token, and the mean length before the first difference."""
    same = total = 0
    first = []
    for a, b in zip(reference, other):
        same += sum(x == y for x, y in zip(a, b))
        total += max(len(a), len(b))
        first.append(next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b))))
    return {"greedy_agreement": same / max(total, 1), "greedy_first_difference": sum(first) / max(len(first), 1)}


def _fp8_squared_error(values: torch.Tensor, scale: torch.Tensor) -> float:
    """Sum of squared errors of ``values`` stored as e4m3 with ``scale`` (broadcast)."""
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    back = (values / safe).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float() * safe
    return (back - values).square().sum().item()


def fp8_scale_granularity(llm, num_tokens: int) -> dict:
    """Relative error of fp8 keys and values stored with one scale per token and head
    against one per page and head (the page's largest value, known in advance: the best a
    per-page scale can do), over the first ``num_tokens`` tokens in pages 0.. of a native
    (full-precision) cache, such as :func:`teacher_forced_logits` leaves it."""
    out: dict = {}
    for part in ("k", "v"):
        per_token = per_page = total = 0.0
        for cache in {id(m.kv_cache): m.kv_cache for m in llm.engine.model.modules()
                      if getattr(m, "kv_cache", None) is not None}.values():
            x = getattr(cache, part).flatten(0, 1)[:num_tokens].float()  # [S, Hk, D]
            bs = cache.k.shape[1]
            pages = x[: num_tokens // bs * bs].unflatten(0, (-1, bs))
            token_scale = x.abs().amax(-1, keepdim=True) / FP8_MAX
            page_scale = pages.abs().amax(dim=(1, 3), keepdim=True) / FP8_MAX
            per_token += _fp8_squared_error(x, token_scale)
            per_page += _fp8_squared_error(pages, page_scale)
            total += x.square().sum().item()
        out[f"fp8_{part}_rel_error_per_token"] = math.sqrt(per_token / total) if total else None
        out[f"fp8_{part}_rel_error_per_page"] = math.sqrt(per_page / total) if total else None
    return out
