"""Multi-LoRA serving: PEFT adapters, mixed per-request adapters in one batch, parity with peft."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from ninfer import LLM, SamplingParams
from ninfer.batch.lora_hook import apply_lora
from ninfer.engine.request import EngineRequest
from ninfer.errors import InvalidRequestError
from ninfer.lora import LoraAdapter, LoraAdapterError

peft = pytest.importorskip("peft")

PROMPTS = [
    "Hello",
    "The quick brown fox jumps over the lazy dog",
    "def add(a, b):\n    return",
    "Once upon a time, in a land far away, there lived",
]
MAX_NEW = 10
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW)
ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# A: every projection, with per-module rank and alpha overrides. B: a different rank,
# rank-stabilised scaling, a regex target list, and only some parts of the fused layers.
ADAPTERS = {
    "A": dict(
        r=4, lora_alpha=8, target_modules=ALL_TARGETS, rank_pattern={"down_proj": 2}, alpha_pattern={"v_proj": 16}
    ),
    "B": dict(r=8, lora_alpha=8, use_rslora=True, target_modules=r".*\.(q_proj|v_proj|up_proj|down_proj)"),
}


def _base(model_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()


@pytest.fixture(scope="module")
def adapters(tiny_qwen3, tmp_path_factory) -> dict[str, Path]:
    """PEFT adapters saved by peft itself, with non-zero B (peft starts B at zero)."""
    paths = {}
    for seed, (name, kwargs) in enumerate(ADAPTERS.items()):
        model = peft.get_peft_model(_base(tiny_qwen3), peft.LoraConfig(**kwargs))
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for pname, param in model.named_parameters():
                if "lora_B" in pname:
                    param.copy_(torch.randn(param.shape, generator=gen) * 0.3)
        paths[name] = tmp_path_factory.mktemp(f"lora-{name}")
        model.save_pretrained(paths[name])
    return paths


def _llm(model_dir: Path, adapters: dict[str, Path], **kw) -> LLM:
    opts = dict(dtype="fp32", device="cpu", max_concurrency=8, block_size=4, prefill_chunk=7)
    return LLM(str(model_dir), lora_modules={k: str(v) for k, v in adapters.items()}, **{**opts, **kw})


@pytest.fixture(scope="module")
def llm(tiny_qwen3, adapters) -> LLM:
    return _llm(tiny_qwen3, adapters)


def _ids(llm: LLM) -> list[list[int]]:
    tok = llm.get_tokenizer()
    return [tok.encode(p) for p in PROMPTS]


def _tokens(results) -> list[list[int]]:
    return [r.outputs[0].token_ids for r in results]


def _peft_greedy(model_dir: Path, adapter: Path, ids: list[list[int]], device: str = "cpu") -> list[list[int]]:
    reference = peft.PeftModel.from_pretrained(_base(model_dir), adapter).eval().to(device)
    out = []
    with torch.no_grad():
        for i in ids:
            gen = reference.generate(
                torch.tensor([i], device=device),
                max_new_tokens=MAX_NEW,
                do_sample=False,
                attention_mask=torch.ones(1, len(i), device=device),
            )
            out.append(gen[0, len(i) :].tolist())
    return out


def _mixed_and_alone(llm: LLM) -> tuple[list[list[int]], list[list[int]]]:
    """Every prompt with A, none and B, all in one batch and then each on its own."""
    rows = [(i, name) for i in _ids(llm) for name in ("A", None, "B")]
    mixed = _tokens(llm.generate([{"prompt_token_ids": i} for i, _ in rows], GREEDY, lora_name=[n for _, n in rows]))
    alone = [_tokens(llm.generate({"prompt_token_ids": i}, GREEDY, lora_name=n))[0] for i, n in rows]
    return mixed, alone


@pytest.mark.parametrize("name", list(ADAPTERS))
def test_greedy_matches_transformers_peft(llm, tiny_qwen3, adapters, name):
    ids = _ids(llm)
    got = _tokens(llm.generate([{"prompt_token_ids": i} for i in ids], GREEDY, lora_name=name))
    assert got == _peft_greedy(tiny_qwen3, adapters[name], ids)


def test_mixed_batch_equals_each_alone(llm, tiny_qwen3):
    ids = _ids(llm)
    mixed, alone = _mixed_and_alone(llm)
    assert mixed == alone
    for k in range(len(ids)):  # the adapters really change the output
        assert len({tuple(t) for t in mixed[3 * k : 3 * k + 3]}) == 3
    plain = _llm(tiny_qwen3, {})  # rows without an adapter match a model that never loaded one
    assert _tokens(plain.generate([{"prompt_token_ids": i} for i in ids], GREEDY)) == mixed[1::3]


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8", "nvfp4", "k8v4"])
def test_adapters_over_a_quantized_kv_cache(tiny_qwen3, adapters, kv_dtype):
    """Rows of different adapters share a batch over every quantized KV format: each row's
    tokens are its own alone, and the adapters still steer the output."""
    llm = _llm(tiny_qwen3, adapters, kv_dtype=kv_dtype)
    mixed, alone = _mixed_and_alone(llm)
    assert mixed == alone
    assert any(len({tuple(t) for t in mixed[3 * k : 3 * k + 3]}) == 3 for k in range(len(PROMPTS)))


#: projections an adapter can target in each other family (attention; Gated DeltaNet's too)
FAMILY_TARGETS = {
    "qwen3_moe": ["q_proj", "k_proj", "v_proj", "o_proj"],
    "qwen3_5_moe": ["q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkv", "in_proj_z", "out_proj"],
}


@pytest.mark.parametrize("family", list(FAMILY_TARGETS))
def test_adapters_on_the_moe_and_hybrid_families(family, tmp_path_factory):
    """An adapter on a MoE and a hybrid MoE model (attention and Gated DeltaNet
    projections) gives transformers + peft's greedy tokens, and rows with and without it
    share a batch."""
    from ninfer.tiny.make import make_tiny

    model_dir = make_tiny(tmp_path_factory.mktemp(f"{family}-base"), family, seed=0)
    torch.manual_seed(0)  # peft draws lora_A from the global generator
    model = peft.get_peft_model(_base(model_dir), peft.LoraConfig(r=4, lora_alpha=8,
                                                                  target_modules=FAMILY_TARGETS[family]))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for pname, param in model.named_parameters():
            if "lora_B" in pname:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.5)
    adapter = tmp_path_factory.mktemp(f"{family}-lora")
    model.save_pretrained(adapter)
    llm = _llm(model_dir, {"A": adapter})
    ids = _ids(llm)[:2]
    rows = [(i, name) for i in ids for name in ("A", None)]
    # the Qwen3.5 presets' presence penalty off: transformers' greedy search knows none
    greedy = SamplingParams(temperature=0, max_tokens=MAX_NEW, presence_penalty=0.0)
    mixed = _tokens(llm.generate([{"prompt_token_ids": i} for i, _ in rows], greedy, lora_name=[n for _, n in rows]))
    assert mixed[0::2] == _peft_greedy(model_dir, adapter, ids)
    assert mixed[1::2] == _tokens(llm.generate([{"prompt_token_ids": i} for i in ids], greedy))
    assert mixed[0::2] != mixed[1::2]  # the adapter steers the output
    # speculation (verify rows of both kinds in one step) keeps every row's tokens
    from test_spec_decode import ReplayProposer

    class ByAdapter(ReplayProposer):  # the same prompt continues differently with the adapter
        def propose(self, seq, limit):
            done, period = seq.num_output_tokens, self.period
            future = self.reference[tuple(seq.token_ids[: seq.num_prompt_tokens]), seq.lora_slot != 0]
            return [(t + 1) % 64 if (done + j) % period == 0 else t for j, t in enumerate(future[done:done + limit])]

    spec = _llm(model_dir, {"A": adapter}, spec="ngram", draft_tokens=3)
    spec.engine.proposer = ByAdapter({(tuple(i), n is not None): out for (i, n), out in zip(rows, mixed)}, period=3)
    assert _tokens(spec.generate([{"prompt_token_ids": i} for i, _ in rows], greedy,
                                 lora_name=[n for _, n in rows])) == mixed
    assert 0 < spec.engine.stats.total_accepted < spec.engine.stats.total_drafted


def test_prefix_reuse_never_crosses_adapters(tiny_qwen3, adapters):
    llm = _llm(tiny_qwen3, adapters, max_concurrency=1)
    prompt = {"prompt_token_ids": _ids(llm)[3]}

    def run(name):
        result = llm.generate(prompt, GREEDY, lora_name=name)[0]
        return result.num_cached_tokens, result.outputs[0].token_ids

    cached_a, first_a = run("A")
    assert cached_a == 0
    cached_b, out_b = run("B")
    cached_none, _ = run(None)
    assert cached_b == 0 and cached_none == 0
    again_cached, again_a = run("A")
    assert again_cached > 0 and again_a == first_a  # reuse still works within one adapter
    assert out_b == _tokens(_llm(tiny_qwen3, adapters).generate(prompt, GREEDY, lora_name="B"))[0]


def test_unknown_lora_name_is_rejected(llm):
    with pytest.raises(InvalidRequestError) as err:
        llm.generate(["Hello", "Hi"], GREEDY, lora_name=["A", "nope"])
    assert err.value.param == "lora_name" and "nope" in err.value.message
    with pytest.raises(InvalidRequestError) as err:
        llm.engine.add_request(EngineRequest("x", [1, 2, 3], GREEDY, lora_name="nope"))
    assert err.value.param == "lora_name"
    assert not llm.engine.has_unfinished()


def _variant(src: Path, dst: Path, config_changes: dict | None = None) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "adapter_config.json").read_text())
    (dst / "adapter_config.json").write_text(json.dumps({**cfg, **(config_changes or {})}))
    return dst


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"use_dora": True}, "DoRA"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"bias": "all"}, "bias"),
        ({"fan_in_fan_out": True}, "fan_in_fan_out"),
        ({"peft_type": "IA3"}, "peft_type"),
        ({"target_modules": ["q_proj"]}, "not in target_modules"),
        ({"rank_pattern": {"down_proj": 2, "q_proj": 3}}, "q_proj: tensors have rank 4, the config says 3"),
    ],
)
def test_unsupported_config_is_rejected(adapters, tmp_path, changes, message):
    path = _variant(adapters["A"], tmp_path / "bad", changes)
    with pytest.raises(LoraAdapterError, match=message):
        LoraAdapter.load("bad", path)


def test_bad_adapter_files_are_rejected(llm, adapters, tmp_path):
    pickled = _variant(adapters["A"], tmp_path / "pickled")
    (pickled / "adapter_model.safetensors").rename(pickled / "adapter_model.bin")
    with pytest.raises(LoraAdapterError, match="pickled"):
        llm.load_lora("pickled", pickled)
    tensors = load_file(adapters["B"] / "adapter_model.safetensors")
    head = _variant(adapters["B"], tmp_path / "head", {"target_modules": ".*"})
    a, b = torch.zeros(8, 64), torch.zeros(llm.engine.vocab_size, 8)
    extra = {"base_model.model.lm_head.lora_A.weight": a, "base_model.model.lm_head.lora_B.weight": b}
    save_file({**tensors, **extra}, head / "adapter_model.safetensors")
    loaded = len(llm.engine.loras)
    with pytest.raises(LoraAdapterError, match="LM head"):
        llm.load_lora("head", head)
    assert len(llm.engine.loras) == loaded and "head" not in llm.engine.loras  # nothing half-installed
    with pytest.raises(LoraAdapterError, match="already loaded"):
        llm.load_lora("A", adapters["A"])


def test_batch_hook_loads_weights_file_paths(tiny_qwen3, adapters, llm):
    fresh = _llm(tiny_qwen3, {})
    weights = str(adapters["B"] / "adapter_model.safetensors")  # the input format names the file
    apply_lora(fresh, {"B": weights})
    apply_lora(fresh, {"B": weights})  # a second run on the same engine keeps it
    with pytest.raises(LoraAdapterError, match="already loaded"):
        apply_lora(fresh, {"B": str(adapters["A"])})
    prompt = {"prompt_token_ids": _ids(fresh)[1]}
    expected = _tokens(llm.generate(prompt, GREEDY, lora_name="B"))
    assert _tokens(fresh.generate(prompt, GREEDY, lora_name="B")) == expected


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_mixed_batch_and_peft_parity(tiny_qwen3, adapters):
    llm = _llm(tiny_qwen3, adapters, device="cuda")
    mixed, alone = _mixed_and_alone(llm)
    assert mixed == alone
    ids = _ids(llm)
    for name, start in (("A", 0), ("B", 2)):
        assert mixed[start::3] == _peft_greedy(tiny_qwen3, adapters[name], ids, device="cuda")


def test_speculation_with_mixed_adapters_gives_the_plain_tokens(tiny_qwen3, adapters, llm):
    """Verify rows of different adapters in one step: greedy output equals decoding without
    speculation, adapter by adapter."""

    from test_spec_decode import ReplayProposer

    names = [None, "A", "B", "A"]
    expected = _tokens(llm.generate(PROMPTS, GREEDY, lora_name=names))
    spec = _llm(tiny_qwen3, adapters, spec="ngram", draft_tokens=3)
    tok = spec.get_tokenizer()
    spec.engine.proposer = ReplayProposer({tuple(tok.encode(p)): out for p, out in zip(PROMPTS, expected)}, period=3)
    assert _tokens(spec.generate(PROMPTS, GREEDY, lora_name=names)) == expected
    assert 0 < spec.engine.stats.total_accepted < spec.engine.stats.total_drafted
