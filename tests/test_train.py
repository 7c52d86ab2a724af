"""ninfer-train on its ``test`` preset: deterministic, in the released qwen3_5 layout, equal to
transformers on the written checkpoint, and served by ninfer's engine token for token."""

from __future__ import annotations

import json

import pytest
import torch

from ninfer.train.presets import PRESETS

PRESET = PRESETS["test"]
PROMPT = "def add(a, b):\n    return a + b\n\n\nclass Point:\n    def __init__(self, x, y):\n"

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: see conftest


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The test preset trained once through the CLI (seed 0)."""
    from ninfer.cli.train import main

    out = tmp_path_factory.mktemp("trained")
    main([str(out), "--preset", "test", "--seed", "0", "-q"])
    return out


def _ours(path):
    """The trainer's own model with the checkpoint's weights."""
    from ninfer.train.pipeline import load_trained

    return load_trained(path, PRESET)


def _prompt_ids(path) -> list[int]:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path / "tokenizer.json")).encode(PROMPT).ids


def test_same_seed_same_files(trained, tmp_path):
    from ninfer.train.pipeline import run_training

    run_training(tmp_path, PRESET, seed=0)
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json", "config.json", "lm_head_shortlist.json"):
        assert (tmp_path / name).read_bytes() == (trained / name).read_bytes(), name


def test_layout_is_the_tiny_qwen3_5_one(trained):
    from ninfer_plugins.models.qwen3_5 import tiny_config

    def keys(d, prefix=""):
        return {prefix + k for k in d} | {x for k, v in d.items() if isinstance(v, dict) for x in keys(v, f"{k}.")}

    config = json.loads((trained / "config.json").read_text())
    assert config["architectures"] == ["Qwen3_5ForConditionalGeneration"]
    assert keys(config) - {"vocab_size", "bos_token_id", "eos_token_id"} == keys(tiny_config())
    assert config["text_config"]["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]


def test_transformers_logits_equal_the_trainers(trained):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(trained, dtype=torch.float32, attn_implementation="eager").eval()
    ids = torch.tensor([_prompt_ids(trained)])
    with torch.no_grad():
        theirs = hf(ids).logits
        ours = _ours(trained)
        mine = ours.logits(ours.hidden(ids))
    torch.testing.assert_close(mine, theirs, atol=1e-4, rtol=1e-4)


def test_mtp_step_equals_a_transformers_decoder_layer(trained):
    """Chain step 1 is fc([norm(embedding); norm(hidden)]) -> one full-attention layer -> norm."""
    from safetensors.torch import load_file
    from transformers import AutoConfig
    from transformers.models.qwen3_5 import modeling_qwen3_5 as hfm

    text = AutoConfig.from_pretrained(trained).text_config
    text._attn_implementation = "eager"
    full = text.layer_types.index("full_attention")
    layer, norms = hfm.Qwen3_5DecoderLayer(text, full), {}
    tensors = load_file(str(trained / "model.safetensors"))
    layer.load_state_dict({n[len("mtp.layers.0."):]: t for n, t in tensors.items() if n.startswith("mtp.layers.0.")})
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        norms[name] = hfm.Qwen3_5RMSNorm(text.hidden_size, text.rms_norm_eps)
        norms[name].weight.data.copy_(tensors[f"mtp.{name}.weight"])
    ours = _ours(trained)
    ids = torch.tensor([_prompt_ids(trained)])
    with torch.no_grad():
        hidden = ours.hidden(ids)
        mine = ours.mtp_chain(ids, hidden, 1)[0]
        n = mine.shape[1]
        emb = norms["pre_fc_norm_embedding"](ours.text.embed_tokens(ids[:, 1 : 1 + n]))
        x = torch.nn.functional.linear(torch.cat([emb, norms["pre_fc_norm_hidden"](hidden[:, :n])], -1),
                                       tensors["mtp.fc.weight"])
        positions = torch.arange(n)[None]
        rope = hfm.Qwen3_5TextRotaryEmbedding(text)(x, positions)
        mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
        theirs = norms["norm"](layer(x, rope, attention_mask=mask, position_ids=positions))
    torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=1e-5)


def test_chained_steps_on_a_subset_of_bases_equal_the_full_chain(trained):
    """Training runs chained steps 2.. at every few bases only; that must change nothing there."""
    model = _ours(trained)
    ids = torch.tensor([_prompt_ids(trained)])
    bases = torch.tensor([0, 3, 4, 11, len(ids[0]) - 4])
    with torch.no_grad():
        hidden = model.hidden(ids)
        for drafts in (False, True):
            full = model.mtp_chain(ids, hidden, 3, drafts=drafts)
            part = model.mtp_chain(ids, hidden, 3, drafts=drafts, bases=bases)
            torch.testing.assert_close(part[0], full[0])
            for a, b in zip(part[1:], full[1:]):
                torch.testing.assert_close(a, b[:, bases], atol=1e-5, rtol=1e-5)


def test_cached_decoding_equals_the_full_forward(trained):
    """The report decodes greedily from the layers' states (conv, recurrent, KV): a prompt,
    then one token per call, must give the full forward pass's hidden states."""
    model = _ours(trained)
    ids = torch.tensor([_prompt_ids(trained)] * 2)
    with torch.no_grad():
        full = model.hidden(ids)
        cache = [{} for _ in model.text.layers]
        parts = [model.hidden(ids[:, :7], cache)]
        parts += [model.hidden(ids[:, i : i + 1], cache, start=i) for i in range(7, ids.shape[1])]
    torch.testing.assert_close(torch.cat(parts, dim=1), full, atol=1e-5, rtol=1e-5)


def test_ninfer_serves_it_greedy_equal(trained):
    from ninfer import LLM, SamplingParams
    from ninfer.train.report import greedy_continue

    llm = LLM(str(trained), device="cpu", dtype="fp32", max_context=256, max_concurrency=2)
    assert llm.engine.model.mtp is not None  # the MTP layer loaded too
    ids = _prompt_ids(trained)
    # plain greedy: Qwen3.5's presets add a presence penalty
    greedy = SamplingParams(temperature=0, presence_penalty=0.0, max_tokens=12, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": ids}], greedy)
    expected = greedy_continue(_ours(trained), torch.tensor([ids]), 12)[0, len(ids):].tolist()
    assert list(out[0].outputs[0].token_ids) == expected
    chat = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(temperature=0, max_tokens=4))
    assert chat[0].outputs[0].finish_reason in ("length", "stop")


def test_report_and_shortlist(trained):
    report = json.loads((trained / "train_report.json").read_text())
    for key in ("perplexity", "acceptance_per_position", "mean_accepted_length", "train_seconds",
                "teacher_forced_agreement", "heldout_tokens", "parameters"):
        assert key in report, key
    assert report["perplexity"] > 1
    rates = report["acceptance_per_position"]
    assert len(rates) == PRESET.mtp_depth and all(0 <= b <= a <= 1 for a, b in zip([1.0] + rates, rates))
    assert report["mean_accepted_length"] == pytest.approx(sum(rates))
    rounds = report["round_acceptance_per_position"]
    assert len(rounds) == PRESET.mtp_depth and all(0 <= b <= a <= 1 for a, b in zip([1.0] + rounds, rounds))
    assert report["tokens_per_round"] == pytest.approx(1 + sum(rounds))

    shortlist = json.loads((trained / "lm_head_shortlist.json").read_text())
    assert shortlist["format"] == "ninfer-lm-head-shortlist" and shortlist["version"] == 1
    special = shortlist["special_token_ids"]
    tokens = json.loads((trained / "tokenizer.json").read_text())
    real = len(tokens["model"]["vocab"]) + len(tokens["added_tokens"])
    assert sorted(shortlist["token_ids"]) == list(range(real))
    assert shortlist["token_ids"][: len(special)] == special
    assert {t["id"] for t in tokens["added_tokens"]} == set(special)
    counts = shortlist["counts"][len(special):]
    assert counts == sorted(counts, reverse=True) and counts[0] > 0


def test_rounds_start_after_the_kept_drafts():
    """The round replay drafts only at the bases an engine's rounds start from."""
    from ninfer.train.report import every_base_acceptance, round_acceptance

    seq = torch.arange(10)[None]  # prompt of 2: the first round's base is 1
    drafts = torch.full((1, 7, 2), -1)  # [B, L - 1 - k, k]: entry [t, j] drafts token t + j + 2
    drafts[0, 1] = torch.tensor([3, 4])  # base 1: both kept -> the next base is 4
    drafts[0, 2] = torch.tensor([4, 5])  # base 2 is skipped by the rounds
    drafts[0, 4] = torch.tensor([6, -1])  # base 4: one kept -> base 6
    replay = round_acceptance(drafts, seq, prompt_len=2)
    # rounds at bases 1, 4, 6 (base 7's drafts would reach past the sequence)
    assert replay["rounds"] == 3
    assert replay["position_acceptance"] == pytest.approx([2 / 3, 1 / 3])
    assert replay["tokens_per_round"] == pytest.approx((3 + 2 + 1) / 3)
    # at every base 1..6: bases 1, 2 and 4 keep the first draft, bases 1 and 2 the second
    assert every_base_acceptance(drafts, seq, prompt_len=2) == pytest.approx([3 / 6, 2 / 6])


def test_delta_rule_equals_the_inference_reference():
    from ninfer.train.delta_rule import chunk_delta_rule
    from ninfer_kernels.gated_delta import chunked, prepare_qk

    gen = torch.Generator().manual_seed(0)
    length, heads, dim = 75, 3, 8  # not a multiple of the chunk: padding is exercised
    q, k = prepare_qk(torch.randn(length, heads, dim, generator=gen), torch.randn(length, heads, dim, generator=gen), heads)
    v = torch.randn(length, heads, dim, generator=gen)
    g = -torch.rand(length, heads, generator=gen)
    beta = torch.rand(length, heads, generator=gen)
    expected, _ = chunked(q, k, v, g, beta, torch.zeros(heads, dim, dim))
    got = chunk_delta_rule(*(t.transpose(0, 1) for t in (q, k, v, g, beta)), chunk=16)
    torch.testing.assert_close(got.transpose(0, 1), expected, atol=1e-5, rtol=1e-5)


def test_time_budget_shortens_the_run_and_its_schedule():
    """``--train-seconds``: the run times its first steps, then takes only what fits, with the
    cosine decaying over the shorter run (its last step at the floor, as a full run's)."""
    from ninfer.train.loop import CALIBRATE_FROM, CALIBRATE_TO, lr_at, steps_within, train
    from ninfer.train.pipeline import build_model
    from ninfer.train.checkpoint import hf_config

    # 20 calibration steps in 2 s: 0.1 s a step; 3 s left at CALIBRATE_FROM fits 30 more
    assert steps_within(3.0, 2.0, PRESETS["default"]) == CALIBRATE_FROM + 30
    assert steps_within(1e9, 2.0, PRESETS["default"]) == PRESETS["default"].steps  # never past the preset
    assert steps_within(0.0, 2.0, PRESETS["default"]) == CALIBRATE_TO  # never before the calibration ends
    assert lr_at(99, PRESETS["default"], 100) == pytest.approx(PRESETS["default"].lr * 0.1, rel=1e-2)

    config = hf_config(PRESET, {"vocab_size": 384, "eos_token_id": 1, "pad_token_id": 0})
    model = build_model(config, PRESET, 0, torch.device("cpu"))
    stream = torch.randint(0, 384, (4096,), generator=torch.Generator().manual_seed(0))
    flag = torch.backends.cuda.matmul.allow_tf32
    out = train(model, stream, PRESET, 0, torch.device("cpu"), max_seconds=1e-6)
    assert out["steps"] == CALIBRATE_TO < PRESET.steps
    # TF32 is for CUDA runs only, and the process's setting is left as it was
    assert out["tf32"] is False and torch.backends.cuda.matmul.allow_tf32 == flag


def test_micro_batches_give_the_whole_batch_gradient():
    """A preset's ``micro_batch`` splits a step's forward and backward, not its gradient."""
    import attrs

    from ninfer.train.checkpoint import hf_config
    from ninfer.train.loop import accumulate_gradients
    from ninfer.train.pipeline import build_model

    config = hf_config(PRESET, {"vocab_size": 384, "eos_token_id": 1, "pad_token_id": 0})
    tokens = torch.randint(0, 384, (PRESET.batch_size, PRESET.seq_len), generator=torch.Generator().manual_seed(0))
    grads, figures = [], []
    for preset in (PRESET, attrs.evolve(PRESET, micro_batch=3)):
        model = build_model(config, preset, 0, torch.device("cpu"))
        figures.append(accumulate_gradients(model, tokens, preset, 0, torch.autocast("cpu", enabled=False)))
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    torch.testing.assert_close(figures[1], figures[0], rtol=1e-5, atol=1e-6)
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:  # float32 sums in another order
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-4, atol=1e-6, msg=name)


def test_random_shape_of_the_gpu_deep_preset_matches_it():
    """``random:train-gpu-deep`` (round costs without training) has the preset's text config."""
    from ninfer.model.random_weights import SHAPES
    from ninfer.train.checkpoint import hf_config

    preset = PRESETS["gpu-deep"]
    text = hf_config(preset, {"vocab_size": preset.vocab_size + 5, "eos_token_id": 1, "pad_token_id": 0})["text_config"]
    shape = SHAPES["train-gpu-deep"]
    for key, value in shape.items():
        if key in ("architectures", "full_attention_interval", "rope_parameters"):
            continue
        assert text[key] == value, key
    assert text["layer_types"].count("full_attention") == preset.num_layers // shape["full_attention_interval"]
    rope = {k: text["rope_parameters"][k] for k in shape["rope_parameters"]}
    assert rope == shape["rope_parameters"]


def test_steps_option_overrides_the_preset(tmp_path):
    from ninfer.cli.train import main

    main([str(tmp_path), "--preset", "test", "--steps", "6", "-q"])
    report = json.loads((tmp_path / "train_report.json").read_text())
    assert report["steps"] == 6 and report["tokens_seen"] == 6 * PRESET.batch_size * PRESET.seq_len


def test_another_stdlib_tree_is_read_and_named_for_the_held_out_side(tmp_path):
    """``--stdlib`` trains on another standard-library tree (the GPU image's Python lacks the
    test suites), and scripts sampling a model's held-out prompts find the same tree again."""
    from ninfer.cli.train import main
    from ninfer.train.corpus import HELDOUT_EVERY, _crc, load_corpus
    from ninfer.train.pipeline import trained_corpus

    tree = tmp_path / "python3.99"
    names = [f"mod{i}.py" for i in range(40)] + [f"test/test_mod{i}.py" for i in range(10)]
    for name in names:
        (tree / name).parent.mkdir(parents=True, exist_ok=True)
        (tree / name).write_text(f"def f_{abs(hash(name))}(x):\n    return x + 1\n" * 200)
    (tree / "site-packages" / "pkg").mkdir(parents=True)
    (tree / "site-packages" / "pkg" / "skipped.py").write_text("x = 1\n")
    out = tmp_path / "model"
    main([str(out), "--preset", "test", "--steps", "1", "--stdlib", str(tree), "-q"])
    report = json.loads((out / "train_report.json").read_text())
    assert report["stdlib"] == str(tree)
    held = trained_corpus(out, 1_000_000)
    assert held.root == str(tree)
    # the test preset leaves the test suites out, on both sides
    assert sorted(held.heldout_files) == sorted(n for n in names[:40] if _crc(n) % HELDOUT_EVERY == 0)
    # by default as many held-out bytes as the report evaluated
    assert trained_corpus(out).heldout_files == load_corpus(1, PRESET.heldout_bytes, root=tree).heldout_files
    with pytest.raises(SystemExit):
        main([str(tmp_path / "other"), "--stdlib", str(tmp_path / "missing")])


@pytest.mark.parametrize("device_rounds", [False, True])
def test_engine_drafts_are_the_trainers_chain(monkeypatch, device_rounds):
    """Lossless verification hides a drafter that drafts the wrong thing; acceptance shows it.
    Every round's MTP drafts must be what the trainer's chain (its own drafts from step 2 on)
    drafts at the same base: the head reads the right hidden state, token and position, and
    its KV holds step 1's keys for every earlier position. Both round paths are checked: the
    host's (proposals) and the device's (the rows a round hands back). The model is the tiny
    random qwen3_5 (the trainer's layout): a trained test-preset model drafts nearly the same
    few tokens everywhere and would miss a wrong position; random weights do not."""
    from ninfer import LLM, SamplingParams
    from ninfer.engine.spec import device_rounds as rounds_module
    from ninfer.plugins import load_registry
    from ninfer.tiny.cache import resolve_model_path
    from ninfer.train.pipeline import load_trained
    from ninfer.train.report import chain_drafts
    from ninfer_plugins.speculative import mtp

    k, drafted = 3, []  # (base, drafts): base t's drafts are tokens t + 2 .. t + k + 1
    if device_rounds:
        run = rounds_module.DeviceRounds.run

        def record(self, bucket, num):
            start = int(self.verify.positions.view(-1, self.width)[0, 0])
            out, bank = run(self, bucket, num)
            row = out[0].tolist()
            drafted.append((start + row[0], row[1 + self.width:]))
            return out, bank

        monkeypatch.setattr(rounds_module.DeviceRounds, "run", record)
    else:
        propose = mtp.MtpProposer.propose

        def record(self, seq, limit):
            out = propose(self, seq, limit)
            drafted.append((seq.num_tokens - 2, list(out)))
            return out

        monkeypatch.setattr(mtp.MtpProposer, "propose", record)
    path = resolve_model_path("tiny:qwen3_5", load_registry())
    llm = LLM(str(path), device="cpu", dtype="fp32", max_context=256, max_concurrency=2, spec="mtp",
              draft_tokens=k, decode_ahead_on_cpu=device_rounds)
    ids = torch.randint(0, 500, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    greedy = SamplingParams(temperature=0, presence_penalty=0.0, max_tokens=48, ignore_eos=True)
    seq = ids + list(llm.generate([{"prompt_token_ids": ids}], greedy)[0].outputs[0].token_ids)

    chain = chain_drafts(load_trained(path, PRESET, positions=256), torch.tensor([seq]), k)[0].tolist()
    compared = [(base, got) for base, got in drafted if got and base + k + 1 < len(seq)]
    assert len(compared) > 10 and len({tuple(got) for _, got in compared}) > 5  # drafts that vary
    for base, got in compared:
        assert got == chain[base][: len(got)], base


def test_a_cuda_run_takes_tf32_for_its_float32_products_and_gives_the_setting_back(monkeypatch):
    """On CUDA the run's float32 products (the delta rule's) may use TF32; the setting is
    the run's alone, and ``NINFER_TRAIN_TF32=0`` keeps full float32."""
    from ninfer.train import loop

    seen = []
    monkeypatch.setattr(loop, "run_steps", lambda *a, **k: seen.append(torch.backends.cuda.matmul.allow_tf32) or {})
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        assert loop.train(None, None, PRESET, 0, torch.device("cuda")) == {"tf32": True}
        monkeypatch.setenv("NINFER_TRAIN_TF32", "0")
        assert loop.train(None, None, PRESET, 0, torch.device("cuda")) == {"tf32": False}
        assert seen == [True, False] and torch.backends.cuda.matmul.allow_tf32 is False
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before
