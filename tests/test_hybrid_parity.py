"""Logits parity of the hybrid families (qwen3_next, qwen3_5, qwen3_5_moe) with transformers,
fp32 on CPU, and of our chunked path with one full prefill of our own.

Our model runs as the engine drives it: varlen batches over shuffled KV pages, recurrent
state in slots that are not the sequences' indices and start out holding garbage, prefill
chunks crossing page boundaries, decode rows mixed with prefill chunks. Transformers runs
each full sequence in one forward.
"""

from __future__ import annotations

import pytest
import torch

from _tiny import shuffled_tables, varlen_batch
from ninfer.model.loader import iter_weights, load_model, read_config
from ninfer.plugins import load_registry
from ninfer.tiny.make import make_tiny

TOL = 1e-4
BLOCK_SIZE = 4
CHUNK = 3
DECODE_STEPS = 8
FAMILIES = ["qwen3_next", "qwen3_5", "qwen3_5_moe"]
PROMPTS = [
    "Hello",
    "The quick brown fox jumps over the lazy dog",
    "def add(a, b):\n    return a + b",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
]


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: see conftest


@pytest.fixture(scope="module")
def registry():
    return load_registry()


@pytest.fixture(scope="module", params=FAMILIES)
def tiny(request, tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp(f"tiny-{request.param}"), request.param, seed=0)


@pytest.fixture(scope="module")
def hf(tiny):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32, attn_implementation="eager").eval()


def _prompt_ids(path) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    return [tok(p)["input_ids"] for p in PROMPTS]


def _ours(path, registry, num_pages: int, num_slots: int):
    model, _, _ = load_model(path, registry, torch.float32, "cpu")
    kv = registry.get("kv_dtype", "bf16")
    specs = model.attention_specs()
    model.bind_kv_caches(
        [kv.allocate(num_pages, BLOCK_SIZE, s.num_kv_heads, s.head_dim, torch.float32, "cpu") for s in specs]
    )
    model.allocate_state(num_slots, "cpu")
    gen = torch.Generator().manual_seed(0)
    for layer in model.model.layers:  # stale contents: sequences starting at 0 must not read them
        if layer.is_linear:
            for pool in (layer.linear_attn.conv_state, layer.linear_attn.ssm_state):
                pool.copy_(torch.randn(pool.shape, generator=gen))
    return model


def _step(model, steps, tables, slots):
    ids, positions, batch = varlen_batch(steps, tables, BLOCK_SIZE)
    batch.state_slots = torch.tensor(slots, dtype=torch.int64)
    with torch.no_grad():
        return model.compute_logits(model(ids, positions, batch))


def _continued(hf, prompts: list[list[int]], steps: int) -> list[list[int]]:
    """Each prompt and transformers' greedy continuation (any tokens would do: the logits
    compared below come from cache-free full forwards)."""
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            gen = hf.generate(ids, max_new_tokens=steps, do_sample=False, attention_mask=torch.ones_like(ids))
            out.append(gen[0].tolist())
    return out


def test_varlen_prefill_matches_transformers(tiny, hf, registry):
    prompts = _prompt_ids(tiny)
    tables, num_pages = shuffled_tables([len(p) for p in prompts], BLOCK_SIZE)
    model = _ours(tiny, registry, num_pages, num_slots=6)
    ours = _step(model, [(0, p) for p in prompts], tables, [5, 0, 3, 2])
    with torch.no_grad():
        expected = torch.cat([hf(torch.tensor([p])).logits[0] for p in prompts])
    assert ours.shape == expected.shape
    assert (ours - expected).abs().max().item() <= TOL


def test_chunked_prefill_and_decode_match_transformers(tiny, hf, registry):
    """CHUNK tokens per step while prefilling, then one per step; steps mix both kinds of rows."""
    prompts = _prompt_ids(tiny)
    full = _continued(hf, prompts, DECODE_STEPS)
    with torch.no_grad():
        expected = [hf(torch.tensor([seq])).logits[0] for seq in full]
    tables, num_pages = shuffled_tables([len(s) for s in full], BLOCK_SIZE, seed=1)
    slots = [4, 1, 5, 2]
    model = _ours(tiny, registry, num_pages, num_slots=6)
    done = [0] * len(full)
    kinds = set()
    while any(d < len(s) for d, s in zip(done, full)):
        active = [i for i, s in enumerate(full) if done[i] < len(s)]
        steps = []
        for i in active:
            end = min(done[i] + CHUNK, len(prompts[i])) if done[i] < len(prompts[i]) else done[i] + 1
            steps.append((done[i], full[i][done[i] : end]))
        kinds.add(tuple(sorted({len(new) == 1 for _, new in steps})))
        ours = _step(model, steps, [tables[i] for i in active], [slots[i] for i in active])
        row = 0
        for i, (start, new) in zip(active, steps):
            diff = (ours[row : row + len(new)] - expected[i][start : start + len(new)]).abs().max().item()
            assert diff <= TOL, f"seq {i} positions {start}..{start + len(new) - 1}: max diff {diff}"
            row += len(new)
            done[i] = start + len(new)
    assert (False, True) in kinds and (True,) in kinds  # mixed steps and decode-only steps both ran


def test_chunked_path_equals_one_full_prefill(tiny, registry):
    """Our own chunked prefill against our own single pass, and the state must matter.

    Independent of transformers, which has dropped recurrent state for multi-token steps
    on a populated cache in some releases.
    """
    prompt = _prompt_ids(tiny)[1] * 2  # long enough for several chunks of 7 (not a page multiple)
    tables, num_pages = shuffled_tables([len(prompt)], BLOCK_SIZE)
    model = _ours(tiny, registry, num_pages, num_slots=3)
    whole = _step(model, [(0, prompt)], tables, [1])
    pieces = []
    for start in range(0, len(prompt), 7):
        pieces.append(_step(model, [(start, prompt[start : start + 7])], tables, [2]))
    assert (torch.cat(pieces) - whole).abs().max().item() <= TOL
    for layer in model.model.layers:
        if layer.is_linear:
            ssm = layer.linear_attn.ssm_state
            assert (ssm[1] - ssm[2]).abs().max().item() <= TOL
            conv = layer.linear_attn.conv_state
            assert (conv[1] - conv[2]).abs().max().item() <= TOL
            ssm[0].zero_()
            layer.linear_attn.conv_state[0].zero_()
    # the last chunk again, but continuing from an empty slot: the output must change a lot
    start = (len(prompt) - 1) // 7 * 7
    amnesiac = _step(model, [(start, prompt[start:])], tables, [0])
    assert (amnesiac - pieces[-1]).abs().max().item() > 0.1


def test_only_full_attention_layers_get_kv_caches(tiny, registry):
    model, config, _ = load_model(tiny, registry, torch.float32, "cpu")
    text = config.get("text_config", config)
    layer_types = [layer.is_linear for layer in model.model.layers]
    assert len(model.attention_specs()) == layer_types.count(False) == 2
    assert model.attention_specs()[0].head_dim == text["head_dim"]
    with pytest.raises(ValueError, match="one per full-attention layer"):
        model.bind_kv_caches([None] * len(layer_types))
    per_slot = model.state_bytes_per_slot()
    linear = text["linear_num_value_heads"] * text["linear_key_head_dim"] * text["linear_value_head_dim"] * 4
    conv = 3 * (2 * text["linear_num_key_heads"] * text["linear_key_head_dim"]
                + text["linear_num_value_heads"] * text["linear_value_head_dim"]) * 4
    assert per_slot == layer_types.count(True) * (linear + conv)
    assert model.allocate_state(3, "cpu") == 3 * per_slot


def test_mtp_weights_load_with_their_shapes(tiny, registry):
    model, config, _ = load_model(tiny, registry, torch.float32, "cpu")
    weights = {n: t for n, t in iter_weights(tiny) if n.startswith("mtp.")}
    hidden = model.cfg.hidden_size
    mtp = model.mtp
    assert mtp is not None and len(mtp.layers) == 1
    assert mtp.fc.weight.shape == (hidden, 2 * hidden)
    assert torch.equal(mtp.fc.weight, weights["mtp.fc.weight"])
    # zero-centred norms hold 1 + w
    assert torch.allclose(mtp.norm.weight, weights["mtp.norm.weight"] + 1)
    attn = mtp.layers[0].self_attn
    q_rows = weights["mtp.layers.0.self_attn.q_proj.weight"].shape[0]
    assert q_rows == 2 * model.cfg.num_heads * model.cfg.head_dim  # query and gate
    assert torch.equal(attn.qkv_proj.weight[:q_rows], weights["mtp.layers.0.self_attn.q_proj.weight"])
    assert (model.cfg.num_experts > 0) == hasattr(mtp.layers[0].mlp, "experts")


def test_vision_tower_is_skipped_with_one_log_line(tiny, registry):
    from loguru import logger

    nested = "text_config" in read_config(tiny)
    lines: list[str] = []
    handle = logger.add(lines.append, format="{message}", level="INFO")
    try:
        load_model(tiny, registry, torch.float32, "cpu")
    finally:
        logger.remove(handle)
    skipped = [line for line in lines if "vision-tower" in line]
    if nested:
        visual = sum(1 for n, _ in iter_weights(tiny) if n.startswith("model.visual."))
        assert len(skipped) == 1 and f"skipped {visual} vision-tower" in skipped[0]
    else:
        assert not skipped


def test_loads_what_transformers_saves(tiny, hf, registry, tmp_path):
    """transformers 5's save_pretrained layout: flat text config, rope_parameters, stacked experts,
    and no MTP weights although the config still declares the layer."""
    hf.save_pretrained(tmp_path)
    prompts = _prompt_ids(tiny)
    tables, num_pages = shuffled_tables([len(p) for p in prompts], BLOCK_SIZE)
    model = _ours(tmp_path, registry, num_pages, num_slots=4)
    assert model.mtp is None
    ours = _step(model, [(0, p) for p in prompts], tables, [0, 1, 2, 3])
    with torch.no_grad():
        expected = torch.cat([hf(torch.tensor([p])).logits[0] for p in prompts])
    assert (ours - expected).abs().max().item() <= TOL


def test_mtp_weights_may_be_absent_but_not_partial(tiny, registry):
    _, config, family = load_model(tiny, registry, torch.float32, "cpu")
    weights = dict(iter_weights(tiny))
    partial = family.build(config, torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError, match="mtp.fc.weight"):
        partial.load_weights((n, t) for n, t in weights.items() if n != "mtp.fc.weight")
    absent = family.build(config, torch.float32, torch.device("cpu"))
    absent.load_weights((n, t) for n, t in weights.items() if not n.startswith("mtp."))
    assert absent.mtp is None
