"""ninfer-bench: the GPU suite preset and one small CPU run of each figure."""

from __future__ import annotations

import json

import pytest

from ninfer.cli import bench


def test_gpu_suite_presets_the_issue_figures_and_flags_still_win():
    args = bench.parse_args(["--suite", "gpu", "--concurrency", "1,8"])
    assert args.model == "random:qwen3-8b" and args.offline_model == "random:qwen3-0.6b"
    assert args.concurrency == "1,8"  # explicit flag kept
    assert args.hf_compiled == "1,8" and args.num_requests == 256 and args.input_len == (100, 1024)
    assert set(args.only.split(",")) == {"bandwidth", "decode", "prefill", "offline"}


def test_cpu_run_prints_one_json_line_per_figure(capsys):
    code = bench.main(["tiny:qwen3", "--device", "cpu", "--only", "decode,prefill,offline", "--concurrency", "2",
                       "--decode-prompt-len", "16", "--decode-output-len", "8", "--prefill-lens", "32",
                       "--num-requests", "3", "--input-len", "8,16", "--output-len", "4,8", "--no-transformers"])
    assert code == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    figures = [(r["figure"], r["engine"]) for r in lines]
    assert figures == [("decode", "ninfer"), ("prefill", "ninfer"), ("offline_throughput", "ninfer")]
    decode = lines[0]
    assert decode["concurrency"] == 2 and decode["decode_tokens"] == 2 * 7 and decode["decode_tok_s"] > 0
    assert lines[1]["prompt_tokens"] == 32 and lines[1]["prefill_tok_s"] > 0
    assert lines[2]["output_tokens"] >= 3 * 4


def test_kv_dtype_flag_reaches_the_engine_and_the_figures(capsys):
    args = ["tiny:qwen3", "--device", "cpu", "--only", "decode", "--concurrency", "1", "--decode-prompt-len", "16",
            "--decode-output-len", "4", "--no-transformers"]
    sizes = {}
    for fmt in ("bf16", "fp8"):
        assert bench.main([*args, "--kv-dtype", fmt]) == 0
        line = next(json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith("{"))
        assert line["kv_dtype"] == fmt
        sizes[fmt] = line["bytes_per_step"]
    assert sizes["fp8"] < sizes["bf16"]  # the step reads the quantized cache's real bytes


def test_decode_with_the_family_presets_samples_as_a_bare_request_does(capsys, monkeypatch):
    """``--sampling presets`` leaves the sampler settings to the family (Qwen3.5: top-k,
    top-p and a presence penalty); the default pins plain greedy."""
    from ninfer.bench import ninfer_runs

    seen = []
    real = ninfer_runs._submit
    monkeypatch.setattr(ninfer_runs, "_submit", lambda engine, work, *a: seen.append(a[-1]) or real(engine, work, *a))
    args = ["tiny:qwen3_5", "--device", "cpu", "--only", "decode", "--concurrency", "1", "--decode-prompt-len", "8",
            "--decode-output-len", "4", "--no-transformers"]
    for sampling in ("greedy", "presets"):
        assert bench.main([*args, "--sampling", sampling]) == 0
        line = next(json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith("{"))
        assert line["sampling"] == sampling and line["decode_tokens"] > 0
    assert seen == [False, True]  # presets off, then on


TINY_HYBRID_MOE = {
    "model_type": "qwen3_5_moe_text", "architectures": ["Qwen3_5MoeForCausalLM"], "vocab_size": 512,
    "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32,
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
    "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32,
    "max_position_embeddings": 512, "tie_word_embeddings": False,
}
TINY_TIED = {
    "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "vocab_size": 512, "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 3, "num_attention_heads": 2, "num_key_value_heads": 1,
    "head_dim": 32, "max_position_embeddings": 512, "tie_word_embeddings": True,
}


def test_random_shapes_are_built_in_memory_and_loaded_through_the_checkpoint_loader(monkeypatch):
    """No weight file: transformers' seeded model streams into our loader, and both engines
    then hold the same weights (our greedy tokens equal transformers' on a rebuilt copy)."""
    import torch

    from ninfer import LLM, SamplingParams
    from ninfer.model import random_weights

    monkeypatch.setitem(random_weights.SHAPES, "tiny-hybrid-moe", TINY_HYBRID_MOE)
    cpu = torch.device("cpu")
    path, weights = random_weights.model_source("random:tiny-hybrid-moe", torch.float32, cpu, seed=3)
    assert not list(__import__("pathlib").Path(path).glob("*.safetensors"))
    llm = LLM(path, device="cpu", dtype="fp32", weights=weights)
    prompt = [5, 17, 99, 3, 250, 42]
    ours = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0].outputs[0]

    hf = random_weights.build_hf("tiny-hybrid-moe", torch.float32, cpu, seed=3)
    with torch.no_grad():
        theirs = hf.generate(torch.tensor([prompt]), max_new_tokens=6, min_new_tokens=6, do_sample=False,
                             pad_token_id=0)[0, len(prompt):].tolist()
    assert ours.token_ids == theirs


def test_the_engine_builder_serves_a_random_shape_by_its_reference(monkeypatch):
    """``ninfer-serve random:SHAPE`` and ``LLM("random:SHAPE")``: the same in-memory weights
    (seed 0) without the benchmark's plumbing, under the reference as the model id."""
    import torch

    from ninfer import LLM, SamplingParams
    from ninfer.model import random_weights

    monkeypatch.setitem(random_weights.SHAPES, "tiny-hybrid-moe", TINY_HYBRID_MOE)
    llm = LLM("random:tiny-hybrid-moe", device="cpu", dtype="fp32")
    assert llm.loaded.model_id == "random:tiny-hybrid-moe"
    prompt = [7, 8, 9, 300]
    ours = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0].outputs[0]
    hf = random_weights.build_hf("tiny-hybrid-moe", torch.float32, torch.device("cpu"), seed=0)
    with torch.no_grad():
        theirs = hf.generate(torch.tensor([prompt]), max_new_tokens=4, min_new_tokens=4, do_sample=False,
                             pad_token_id=0)[0, len(prompt):].tolist()
    assert ours.token_ids == theirs


def test_unknown_random_shapes_fail_the_profile_check():
    import pytest

    from ninfer.profile import ProfileError, load_profile

    with pytest.raises(ProfileError, match="model: unknown random shape 'qwen9-1t'"):
        load_profile(None, model="random:qwen9-1t")


@pytest.mark.parametrize("shape,block_bytes", [("tiny-hybrid-moe", 1), ("tiny-tied", 1), ("tiny-tied", 1 << 30)])
def test_streamed_random_weights_are_the_baselines_and_each_block_is_freed_before_the_next(monkeypatch, shape,
                                                                                           block_bytes):
    """A 35B-A3B in bf16 is 67 GB: built whole beside our copy it does not fit an 80 GB H100.
    The stream makes one block at a time and drops it before making the next, with the
    same tensors transformers' baseline gets from the same seed (a tied head once)."""
    import gc
    import weakref

    import torch

    from ninfer.model import blockwise_init, random_weights

    monkeypatch.setitem(random_weights.SHAPES, "tiny-hybrid-moe", TINY_HYBRID_MOE)
    monkeypatch.setitem(random_weights.SHAPES, "tiny-tied", TINY_TIED)
    monkeypatch.setattr(blockwise_init, "BLOCK_BYTES", block_bytes)  # 1: every layer its own block
    cpu = torch.device("cpu")
    baseline = random_weights.build_hf(shape, torch.float32, cpu, seed=5).state_dict()
    model = random_weights._meta_hf(shape, torch.float32)
    owners, names = {}, []  # the module's own tensor (not the view handed out) must die with its block
    for name, tensor in blockwise_init.stream(model, cpu, seed=5):
        assert torch.equal(tensor, baseline[name]), name
        names.append(name)
        owner = model.get_submodule(name.rpartition(".")[0])
        owners[name] = weakref.ref(dict(_own_tensors(owner))[name.rpartition(".")[2]])
        del tensor
        gc.collect()
        layer = int(name.split(".")[2]) if name.startswith("model.layers.") else None
        earlier = [n for n in owners if block_bytes == 1 and layer is not None and n.startswith("model.layers.")
                   and int(n.split(".")[2]) < layer]
        assert all(owners[n]() is None for n in earlier), name
    tied = shape == "tiny-tied"  # the head handed out once, as the embedding, even inside one block
    assert set(names) == set(baseline) - ({"lm_head.weight"} if tied else set())
    if tied:
        assert torch.equal(baseline["lm_head.weight"], baseline["model.embed_tokens.weight"])


def _own_tensors(module):
    import itertools

    return itertools.chain(module.named_parameters(recurse=False), module.named_buffers(recurse=False))


def test_a_tensor_no_initialiser_reaches_fails_the_build(monkeypatch):
    import torch

    from ninfer.model import random_weights

    monkeypatch.setitem(random_weights.SHAPES, "tiny-hybrid-moe", TINY_HYBRID_MOE)
    model = random_weights._meta_hf("tiny-hybrid-moe", torch.float32)
    init = model._init_weights
    monkeypatch.setattr(model, "_init_weights", 
                        lambda m: None if type(m).__name__.endswith(("Router", "SparseMoeBlock")) else init(m))
    with pytest.raises(RuntimeError, match=r"left model\.layers\.0\.mlp\.gate\.weight unset"):
        random_weights.blockwise_init.whole(model, torch.device("cpu"), 0)


def test_decode_traffic_counts_only_the_experts_a_step_reaches(tiny_qwen3_moe):
    from ninfer import LLM
    from ninfer.bench.bandwidth import weight_bytes_read_per_step

    model = LLM(str(tiny_qwen3_moe), device="cpu", dtype="fp32").engine.model
    everything = sum(p.nbytes for p in model.parameters())
    experts = [m for m in model.modules() if hasattr(m, "weight_bytes_read")]
    assert experts
    one, many = weight_bytes_read_per_step(model, 1), weight_bytes_read_per_step(model, 10_000)
    routed = sum(m.experts.gate_up_proj.nbytes + m.experts.down_proj.nbytes for m in experts)
    per_token = sum(m.top_k * (m.experts.gate_up_proj[0].nbytes + m.experts.down_proj[0].nbytes) for m in experts)
    # tied embeddings: the head reads the whole table, so every parameter counts once
    assert many == everything
    assert one == everything - routed + per_token


def test_random_hybrid_shapes_get_an_mtp_head_so_mtp_speculation_runs(monkeypatch):
    """transformers builds no MTP layer; the family's random_extras adds one, in the
    released tensor names, and speculation over it stays lossless."""
    import torch

    from ninfer import LLM, SamplingParams
    from ninfer.model import random_weights

    monkeypatch.setitem(random_weights.SHAPES, "tiny-hybrid-moe-mtp", {**TINY_HYBRID_MOE, "mtp_num_hidden_layers": 1})
    llm = LLM("random:tiny-hybrid-moe-mtp", device="cpu", dtype="fp32", spec="mtp", draft_tokens=2)
    assert llm.engine.model.mtp is not None
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    ours = llm.generate([[7, 8, 9, 300]], params)[0].outputs[0]
    hf = random_weights.build_hf("tiny-hybrid-moe-mtp", torch.float32, torch.device("cpu"), seed=0)
    with torch.no_grad():
        theirs = hf.generate(torch.tensor([[7, 8, 9, 300]]), max_new_tokens=6, min_new_tokens=6, do_sample=False,
                             pad_token_id=0)[0, 4:].tolist()
    assert ours.token_ids == theirs and llm.engine.stats.total_drafted > 0


def test_synthetic_context_decodes_after_the_last_prompt_token_only(capsys):
    """--synthetic-context: a 40-token prompt with 8-token prefill chunks yields its first
    token in the first step (a real prefill takes five), on a hybrid model whose recurrent
    state is then whatever its slot held; every --decode-prompt-len gets its own record."""
    from ninfer import LLM
    from ninfer.bench import ninfer_runs
    from ninfer.bench.workload import fixed_workload

    llm = LLM("tiny:qwen3_5", device="cpu", dtype="fp32", prefill_chunk=8, max_context=128, max_num_seqs=2,
              kv_capacity=512)
    engine = llm.engine
    work = fixed_workload(2, 40, 3, 200)
    with ninfer_runs.synthetic_contexts(engine):
        ninfer_runs._submit(engine, work, "syn", synthetic=True)
        first = engine.step()
        assert sorted(e.request_id for e in first if e.token_ids) == ["syn0", "syn1"]
        assert [s.num_computed_tokens for s in engine.scheduler.running] == [40, 40]
    while engine.has_unfinished():
        engine.step()
    assert "allocate" not in vars(engine.scheduler.block_manager)  # the real admission again
    ninfer_runs._submit(engine, work, "real")
    assert not [e for e in engine.step() if e.token_ids]

    assert bench.main(["tiny:qwen3_5", "--device", "cpu", "--only", "decode", "--concurrency", "1",
                       "--decode-prompt-len", "24,48", "--decode-output-len", "4", "--synthetic-context",
                       "--no-transformers"]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith("{")]
    assert [(r["prompt_len"], r["context"]) for r in lines] == [(24, "synthetic (no prefill)"),
                                                                 (48, "synthetic (no prefill)")]
    assert lines[1]["bytes_per_step"] > lines[0]["bytes_per_step"]  # the longer context's KV counted


def test_speculating_engines_hold_every_row_of_their_largest_batch(capsys, monkeypatch):
    """A speculating request reserves KV slots for its drafts (Sequence.spec_slack), so the
    bench sizes the speculating engines' KV for them: with the decode requests filling whole
    pages and the context longer than a request, every batch still runs all its rows (session
    39: the c=8 sample ran seven rows at a time on an H100)."""
    from ninfer.model import random_weights

    monkeypatch.setitem(random_weights.SHAPES, "tiny-hybrid-moe-mtp", {**TINY_HYBRID_MOE, "mtp_num_hidden_layers": 1})
    assert bench.main(["random:tiny-hybrid-moe-mtp", "--device", "cpu", "--dtype", "fp32", "--only", "decode",
                       "--spec", "mtp", "--draft-tokens", "2", "--concurrency", "4", "--decode-prompt-len", "16",
                       "--decode-output-len", "16", "--input-len", "8,40", "--output-len", "8,8",
                       "--no-transformers"]) == 0
    spec = [json.loads(x) for x in capsys.readouterr().out.splitlines() if '"spec_decode"' in x]
    assert [r["draft_tokens"] for r in spec] == [0, 2]
    assert all(r["full_batch"] for r in spec)


def test_spec_decode_pools_the_same_prompt_sample_at_every_concurrency(capsys, monkeypatch):
    """Every concurrency decodes the same sixteen prompts (sixteen single requests at c=1,
    four batches of four at c=4), after an untimed warm-up batch, with and without speculation."""
    from ninfer.bench import ninfer_runs, spec_decode
    from ninfer.model import random_weights

    monkeypatch.setitem(random_weights.SHAPES, "tiny-hybrid-moe-mtp", {**TINY_HYBRID_MOE, "mtp_num_hidden_layers": 1})
    calls = []
    real = ninfer_runs.decode_throughput
    monkeypatch.setattr(ninfer_runs, "decode_throughput", lambda engine, work, *a, **k: (
        calls.append((len(work.prompts), work.output_lens[0], work.prompts[0][:4])) or real(engine, work, *a, **k)))
    code = bench.main(["random:tiny-hybrid-moe-mtp", "--device", "cpu", "--dtype", "fp32", "--only", "decode",
                       "--spec", "mtp", "--draft-tokens", "2", "--concurrency", "1,4", "--decode-prompt-len", "8",
                       "--decode-output-len", "6", "--no-transformers"])
    assert code == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith("{")]
    spec = [r for r in lines if r["figure"] == "spec_decode"]
    assert [(r["draft_tokens"], r["concurrency"], r["prompts"]) for r in spec] == [(0, 1, 16), (0, 4, 16),
                                                                                   (2, 1, 16), (2, 4, 16)]
    assert spec[2]["speedup"] > 0 and len(spec[2]["position_acceptance"]) == 2
    # the engine thread's split per step or round over the timed steps: on CPU the forward
    # runs in the host's share
    assert all(r["host_ms"] > 0 and 0 <= r["device_wait_ms"] < r["host_ms"] for r in spec)
    # every timed step the bench took is one the engine counted as a decode step
    assert all(r["host_steps"] == round(1000 * r["seconds"] / r["step_ms"]) for r in spec)
    decode = [r for r in lines if r["figure"] == "decode"]
    assert decode and all(r["host_ms"] > 0 for r in decode)
    # after the plain decode figure (c=1, then 4): per engine and concurrency the warm-up
    # (32 tokens), then the sample's batches of c
    assert [n for n, _, _ in calls[:2]] == [1, 4]
    calls = calls[2:]
    sample = [call for call in calls if call[1] == 6]
    assert [n for n, _, _ in sample].count(1) == 2 * 16 and [n for n, _, _ in sample].count(4) == 2 * 4
    firsts = {tuple(p) for n, _, p in sample if n == 1}
    assert len(firsts) == 16  # sixteen different prompts, not one repeated
    assert sum(1 for n, out, _ in calls if out == 32) == 4
    assert spec_decode.SAMPLE_PROMPTS == 16


def test_a_text_sample_has_a_random_token_plain_peer_too(capsys, monkeypatch, tmp_path):
    """With --spec-prompts the plain engine decodes the text sample and then random-token
    prompts pooled the same way (a record of its own, no speedup drawn from it); the
    speculating engines decode the text only, and their speedup is over the text's peer."""
    from ninfer.model import random_weights

    monkeypatch.setitem(random_weights.SHAPES, "tiny-hybrid-moe-mtp", {**TINY_HYBRID_MOE, "mtp_num_hidden_layers": 1})
    text = tmp_path / "heldout.txt"
    text.write_text("def add(a, b):\n    return a + b\n\n" * 80)
    assert bench.main(["random:tiny-hybrid-moe-mtp", "--device", "cpu", "--dtype", "fp32", "--only", "decode",
                       "--spec", "mtp", "--draft-tokens", "1", "--concurrency", "1", "--decode-prompt-len", "8",
                       "--decode-output-len", "4", "--no-transformers", "--spec-prompts", str(text)]) == 0
    spec = [json.loads(x) for x in capsys.readouterr().out.splitlines() if '"spec_decode"' in x]
    assert [(r["draft_tokens"], r["sample"]) for r in spec] == [(0, "text"), (0, "random tokens"), (1, "text")]
    assert spec[1]["prompts"] == 16 and "speedup" not in spec[1]
    assert spec[2]["speedup"] == pytest.approx(spec[2]["decode_tok_s"] / spec[0]["decode_tok_s"])


def test_lm_head_draft_reaches_the_engine_and_the_records(capsys, monkeypatch):
    """``--lm-head-draft N``: the speculating engines draft over the shortlist's first N
    entries (a random shape's own shortlist file), and each spec record says so."""
    from ninfer.model import random_weights
    from ninfer_plugins.speculative import shortlist_head

    monkeypatch.setitem(random_weights.SHAPES, "tiny-hybrid-moe-mtp", {**TINY_HYBRID_MOE, "mtp_num_hidden_layers": 1})
    sizes = []
    real = shortlist_head.ShortlistHead.__init__
    monkeypatch.setattr(shortlist_head.ShortlistHead, "__init__",
                        lambda head, weight, ids: sizes.append(len(ids)) or real(head, weight, ids))
    assert bench.main(["random:tiny-hybrid-moe-mtp", "--device", "cpu", "--dtype", "fp32", "--only", "decode",
                       "--spec", "mtp", "--draft-tokens", "2", "--concurrency", "1", "--decode-prompt-len", "8",
                       "--decode-output-len", "4", "--no-transformers", "--lm-head-draft", "64"]) == 0
    spec = [json.loads(x) for x in capsys.readouterr().out.splitlines() if '"spec_decode"' in x]
    assert [(r["draft_tokens"], r["lm_head_draft"]) for r in spec] == [(0, None), (2, 64)]
    assert sizes == [64]  # the plain engine has no proposer


def test_the_spec_sample_spreads_its_text_prompts_over_the_whole_text():
    """Text prompts are windows from the whole held-out text, the same at every concurrency,
    not its first stretches (one file's header)."""
    from ninfer.bench import spec_decode

    ids = list(range(1000))
    n = spec_decode.SAMPLE_PROMPTS
    singles = [spec_decode.batch_work(ids, 1, b, 10, 5, 0, 0).prompts[0] for b in range(n)]
    eights = [p for b in range(n // 8) for p in spec_decode.batch_work(ids, 8, b, 10, 5, 0, 0).prompts]
    assert singles == eights and len({tuple(p) for p in singles}) == n
    assert singles[0] == list(range(10)) and singles[-1] == list(range(990, 1000))  # first and last windows
    assert all(len(p) == 10 and p == list(range(p[0], p[0] + 10)) and p[0] % 10 == 0 for p in singles)
    with pytest.raises(ValueError, match="need more"):
        spec_decode.batch_work(ids[:100], 1, 0, 10, 5, 0, 0)


def test_spec_acceptance_takes_rates_or_a_training_reports_round_replay(tmp_path, capsys):
    from ninfer.bench.spec_cost import expected_tokens

    assert bench.parse_args(["--spec-acceptance", "0.8,0.5"]).spec_acceptance == ([0.8, 0.5], "given")
    # a report's shares of rounds keeping drafts 1..j become each draft's rate given the ones before
    report = tmp_path / "train_report.json"
    report.write_text(json.dumps({"acceptance_per_position": [0.7, 0.5, 0.3],
                                  "round_acceptance_per_position": [0.6, 0.3, 0.0]}))
    rates, source = bench.parse_args(["--spec-acceptance", str(report)]).spec_acceptance
    assert rates == pytest.approx([0.6, 0.5, 0.0]) and "round_acceptance_per_position" in source
    assert expected_tokens(rates) == pytest.approx(1 + 0.6 + 0.3)  # 1 + the shares' sum
    # an older report (every base only), and a bad value named with the flag
    report.write_text(json.dumps({"acceptance_per_position": [0.5, 0.25]}))
    assert bench.parse_args(["--spec-acceptance", str(report)]).spec_acceptance[0] == pytest.approx([0.5, 0.5])
    with pytest.raises(SystemExit):
        bench.parse_args(["--spec-acceptance", "0.8,lots"])
    assert "--spec-acceptance '0.8,lots'" in capsys.readouterr().err
