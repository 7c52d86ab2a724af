"""Logits parity of the qwen3 / qwen3_moe families with transformers, fp32 on CPU.

Our model runs over the paged KV cache exactly as the engine drives it (varlen batches,
prefill chunks crossing page boundaries, shuffled pages, decode steps); transformers
runs each full sequence without a cache. Logits must agree row for row.
"""

from __future__ import annotations

import pytest
import torch

from _tiny import shuffled_tables, varlen_batch
from ninfer.model.loader import iter_weights, load_model, read_config
from ninfer.plugins import load_registry

TOL = 1e-4
BLOCK_SIZE = 4
CHUNK = 3
DECODE_STEPS = 10
PROMPTS = [
    "Hello",
    "The quick brown fox jumps over the lazy dog",
    "def add(a, b):\n    return a + b",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
]


@pytest.fixture(scope="module")
def registry():
    return load_registry()


def _hf_model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


def _prompt_ids(path) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    return [tok(p)["input_ids"] for p in PROMPTS]


def _ours(path, registry, num_pages: int):
    model, _, _ = load_model(path, registry, torch.float32, "cpu")
    kv = registry.get("kv_dtype", "bf16")
    specs = model.attention_specs()
    model.bind_kv_caches(
        [kv.allocate(num_pages, BLOCK_SIZE, s.num_kv_heads, s.head_dim, torch.float32, "cpu") for s in specs]
    )
    return model


def _greedy_continuations(hf, prompts: list[list[int]], steps: int) -> list[list[int]]:
    """Each prompt extended by transformers' own greedy tokens (no EOS stop)."""
    seqs = [list(p) for p in prompts]
    with torch.no_grad():
        for seq in seqs:
            for _ in range(steps):
                seq.append(int(hf(torch.tensor([seq])).logits[0, -1].argmax()))
    return seqs


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
def test_varlen_prefill_matches_transformers(family, registry, request):
    path = request.getfixturevalue(f"tiny_{family}")
    hf, prompts = _hf_model(path), _prompt_ids(path)
    assert len({len(p) for p in prompts}) == len(prompts), "prompts should differ in length"
    tables, num_pages = shuffled_tables([len(p) for p in prompts], BLOCK_SIZE)
    model = _ours(path, registry, num_pages)
    ids, positions, batch = varlen_batch([(0, p) for p in prompts], tables, BLOCK_SIZE)
    with torch.no_grad():
        ours = model.compute_logits(model(ids, positions, batch))
        expected = torch.cat([hf(torch.tensor([p])).logits[0] for p in prompts])
    assert ours.dtype == torch.float32 and ours.shape == expected.shape
    assert (ours - expected).abs().max().item() <= TOL


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
def test_chunked_prefill_and_decode_match_transformers(family, registry, request):
    """Prompts prefilled CHUNK tokens per step, then one token per step, all in one batch.

    Shorter prompts start decoding while longer ones still prefill, so steps mix both
    kinds of rows; the final steps are decode-only.
    """
    path = request.getfixturevalue(f"tiny_{family}")
    hf, prompts = _hf_model(path), _prompt_ids(path)
    full = _greedy_continuations(hf, prompts, DECODE_STEPS)
    with torch.no_grad():
        expected = [hf(torch.tensor([seq])).logits[0] for seq in full]
    tables, num_pages = shuffled_tables([len(s) for s in full], BLOCK_SIZE, seed=1)
    model = _ours(path, registry, num_pages)

    done = [0] * len(full)
    decode_only_steps = 0
    while any(d < len(s) for d, s in zip(done, full)):
        active = [i for i, s in enumerate(full) if done[i] < len(s)]
        steps = []
        for i in active:
            prefilling = done[i] < len(prompts[i])
            end = min(done[i] + CHUNK, len(prompts[i])) if prefilling else done[i] + 1
            steps.append((done[i], full[i][done[i] : end]))
        ids, positions, batch = varlen_batch(steps, [tables[i] for i in active], BLOCK_SIZE)
        decode_only_steps += batch.is_decode_only
        with torch.no_grad():
            ours = model.compute_logits(model(ids, positions, batch))
        row = 0
        for i, (start, new) in zip(active, steps):
            want = expected[i][start : start + len(new)]
            diff = (ours[row : row + len(new)] - want).abs().max().item()
            assert diff <= TOL, f"seq {i} positions {start}..{start + len(new) - 1}: max diff {diff}"
            row += len(new)
            done[i] = start + len(new)
    assert decode_only_steps >= 8


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
def test_loads_what_transformers_saves(family, registry, request, tmp_path):
    """transformers 5's save_pretrained layout (rope_parameters, num_local_experts, dtype)."""
    path = request.getfixturevalue(f"tiny_{family}")
    hf = _hf_model(path)
    hf.save_pretrained(tmp_path)
    prompts = _prompt_ids(path)
    tables, num_pages = shuffled_tables([len(p) for p in prompts], BLOCK_SIZE)
    model = _ours(tmp_path, registry, num_pages)
    ids, positions, batch = varlen_batch([(0, p) for p in prompts], tables, BLOCK_SIZE)
    with torch.no_grad():
        ours = model.compute_logits(model(ids, positions, batch))
        expected = torch.cat([hf(torch.tensor([p])).logits[0] for p in prompts])
    assert (ours - expected).abs().max().item() <= TOL


def _stack_experts(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The same checkpoint with each layer's experts fused the way transformers 5 holds them."""
    out = {n: t for n, t in weights.items() if ".mlp.experts." not in n}
    layers = {n.split(".mlp.experts.")[0] for n in weights if ".mlp.experts." in n}
    for layer in layers:
        def stack(proj: str) -> torch.Tensor:
            names = sorted(
                (n for n in weights if n.startswith(f"{layer}.mlp.experts.") and n.endswith(f".{proj}.weight")),
                key=lambda n: int(n.split(".")[-3]),
            )
            return torch.stack([weights[n] for n in names])

        out[f"{layer}.mlp.experts.gate_up_proj"] = torch.cat([stack("gate_proj"), stack("up_proj")], dim=1)
        out[f"{layer}.mlp.experts.down_proj"] = stack("down_proj")
    return out


def test_stacked_expert_layout_loads_like_per_expert(tiny_qwen3_moe, registry):
    """Experts stored fused (gate_up_proj [E, 2I, H], down_proj [E, H, I]) load identically."""
    per_expert, _, family = load_model(tiny_qwen3_moe, registry, torch.float32, "cpu")
    stacked = family.build(read_config(tiny_qwen3_moe), torch.float32, torch.device("cpu"))
    stacked.load_weights(_stack_experts(dict(iter_weights(tiny_qwen3_moe))).items())
    for (name, a), (_, b) in zip(per_expert.named_parameters(), stacked.named_parameters()):
        assert torch.equal(a, b), name
