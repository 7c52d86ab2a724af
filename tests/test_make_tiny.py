"""ninfer-make-tiny: deterministic tiny checkpoints that transformers loads cleanly."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from ninfer.cli.make_tiny import main
from ninfer.model.loader import iter_weights, weight_files
from ninfer.tiny.make import VOCAB_MULTIPLE, make_tiny

FAMILIES = ["qwen3", "qwen3_moe"]
#: hybrid Gated DeltaNet families (checkpoints built per test: conftest has fixtures for FAMILIES only)
HYBRID = ["qwen3_next", "qwen3_5", "qwen3_5_moe"]


def _files(path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


@pytest.mark.parametrize("family", FAMILIES + HYBRID)
def test_same_seed_gives_identical_files(family, tmp_path):
    a = make_tiny(tmp_path / "a", family, seed=3)
    b = make_tiny(tmp_path / "b", family, seed=3)
    c = make_tiny(tmp_path / "c", family, seed=4)
    assert _files(a) == _files(b)
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()


@pytest.mark.parametrize("family", FAMILIES)
def test_transformers_loads_it_without_key_mismatches(family, request):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = request.getfixturevalue(f"tiny_{family}")
    model, info = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    tok = AutoTokenizer.from_pretrained(path)
    config = json.loads((path / "config.json").read_text())
    assert config["vocab_size"] % VOCAB_MULTIPLE == 0 and config["vocab_size"] >= len(tok)
    generation = json.loads((path / "generation_config.json").read_text())
    assert tok.convert_tokens_to_ids("<|im_end|>") in generation["eos_token_id"]
    assert model.config.model_type == family


def test_one_family_ties_embeddings_and_the_other_does_not(tiny_qwen3, tiny_qwen3_moe):
    untied = dict(iter_weights(tiny_qwen3))
    tied = dict(iter_weights(tiny_qwen3_moe))
    assert "lm_head.weight" in untied and "lm_head.weight" not in tied
    assert json.loads((tiny_qwen3_moe / "config.json").read_text())["tie_word_embeddings"] is True


def test_greedy_output_is_not_degenerate(tiny_qwen3_moe):
    """Logits are spread: different prompts continue differently and not with one repeated token."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_qwen3_moe, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(tiny_qwen3_moe)
    outputs = []
    for prompt in ["Hello there", "def f(x):", "1 2 3 4"]:
        ids = tok(prompt, return_tensors="pt")["input_ids"]
        gen = model.generate(
            ids, max_new_tokens=12, do_sample=False, attention_mask=torch.ones_like(ids), eos_token_id=None
        )
        outputs.append(tuple(gen[0, ids.shape[1] :].tolist()))
    assert len(set(outputs)) == len(outputs)
    assert all(len(set(o)) > 3 for o in outputs)


def test_cli_writes_sharded_checkpoint(tmp_path, capsys):
    main([str(tmp_path / "sharded"), "--family", "qwen3_moe", "--seed", "0", "--shards", "3"])
    out = tmp_path / "sharded"
    assert capsys.readouterr().out.strip() == str(out)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert files == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert [p.name for p in weight_files(out)] == files
    for file in files:
        with safe_open(str(out / file), framework="pt") as f:
            assert set(f.keys()) == {n for n, v in index["weight_map"].items() if v == file}
    single = make_tiny(tmp_path / "single", "qwen3_moe", seed=0)
    sharded, whole = dict(iter_weights(out)), dict(iter_weights(single))
    assert sharded.keys() == whole.keys()
    assert all(torch.equal(sharded[n], whole[n]) for n in whole)


def test_cli_rejects_unknown_family(tmp_path):
    with pytest.raises(SystemExit):
        main([str(tmp_path / "x"), "--family", "llama9"])


@pytest.mark.parametrize("family", HYBRID)
def test_hybrid_checkpoints_load_in_transformers_with_mtp_weights(family, tmp_path):
    """The text model loads without key mismatches; vision-language layouts load whole too."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    path = make_tiny(tmp_path / family, family, seed=0)
    model, info = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    config = json.loads((path / "config.json").read_text())
    text = config.get("text_config", config)
    assert model.config.model_type == text["model_type"]
    assert text["vocab_size"] == config["vocab_size"]  # the nested copy agrees with make_tiny's
    names = dict(iter_weights(path))
    mtp = [n for n in names if n.startswith("mtp.")]
    assert "mtp.fc.weight" in mtp and any(n.startswith("mtp.layers.0.self_attn.") for n in mtp)
    if "vision_config" in config:
        assert any(n.startswith("model.visual.") for n in names)
        full, info = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32, output_loading_info=True)
        assert not info["missing_keys"] and not info["mismatched_keys"]
        assert type(full).__name__ == config["architectures"][0]


def test_cli_writes_a_hybrid_family(tmp_path, capsys):
    main([str(tmp_path / "next"), "--family", "qwen3_next"])
    assert capsys.readouterr().out.strip() == str(tmp_path / "next")
    assert json.loads((tmp_path / "next" / "config.json").read_text())["architectures"] == ["Qwen3NextForCausalLM"]
