"""The figures ``ninfer-bench`` prints, each one JSON line per engine and setup.

Our engine runs every figure first; then it is freed and transformers runs the same
workloads (``baseline``), so a model that fills most of the device's memory still fits
once for each engine.
"""

from __future__ import annotations

import gc
import platform
from typing import Callable

import torch

from ninfer.bench import bandwidth as bw
from ninfer.bench import hf_runs, ninfer_runs
from ninfer.model import random_weights
from ninfer.bench.prefill import hf_prefill, ninfer_prefill
from ninfer.bench.workload import fixed_workload, random_workload


def graph_replay_ms(engine, batch: int, repeats: int = 50) -> float | None:
    """Milliseconds one replay of the decode graph for ``batch`` rows takes back to back,
    i.e. the forward pass without any host work between steps (with the LM head and its
    argmax in buckets that capture them: ``graph_head`` in the record)."""
    graphs = engine.runner.graphs
    bucket = graphs.bucket_for(batch) if graphs is not None else None
    if bucket is None:
        return None
    return bw.cuda_ms(lambda: graphs.replay(bucket), repeats)


def _free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


class Bench:
    """Holds one loaded engine (ours, or transformers for the baseline) at a time."""

    def __init__(self, args, emit: Callable[[dict], None]):
        self.args, self.emit = args, emit
        self.llm = self.hf = None
        self.copy_bw: float | None = None

    def load(self, model: str, decode_levels: list[int], prefill_lens: list[int], offline: bool,
             draft_tokens: int = 0) -> None:
        """Our engine for ``model``: a checkpoint directory, ``tiny:FAMILY`` or ``random:SHAPE``;
        with ``draft_tokens``, speculating with ``--spec``'s backend."""
        from ninfer import LLM
        from ninfer.engine.builder import resolve_device, resolve_dtype
        from ninfer.model.sources import resolve_source
        from ninfer.plugins import load_registry

        a = self.args
        self.unload()
        longest = max([a.input_len[1] + a.output_len[1], a.decode_prompt_len + a.decode_output_len]
                      + [n + 1 for n in prefill_lens] + ([max(a.spec_context) + 64] if "spec_cost" in a.only else []))
        max_seqs = max([a.max_concurrency] + decode_levels)
        # KV for the largest decode batch, a whole offline run at its longest, or one long prompt.
        # A speculating request holds its draft count of slots more (Sequence.spec_slack), and
        # each sequence rounds up to whole pages (64 tokens covers every page size we use)
        per_seq = -(-(a.decode_prompt_len + a.decode_output_len + draft_tokens) // 64) * 64
        kv = max(longest, per_seq * max(decode_levels or [1]),
                 a.num_requests * (a.input_len[1] + a.output_len[1]) if offline else 0)
        device_arg = int(a.device) if a.device.isdigit() else a.device
        device = resolve_device(device_arg)
        dtype = resolve_dtype(a.dtype, device)
        path, weights = resolve_source(model, load_registry(), dtype, device, a.seed)
        spec = dict(spec=a.spec, draft_tokens=draft_tokens) if draft_tokens else {}
        if draft_tokens and a.lm_head_draft:
            spec.update(lm_head_draft=True, lm_head_draft_size=a.lm_head_draft)
        self.llm = LLM(str(path), device=device_arg, dtype=a.dtype,
                       max_num_seqs=max_seqs, max_context=longest, kv_capacity=kv, prefill_chunk=a.prefill_chunk,
                       cuda_graph=not a.no_cuda_graph, weights=weights, kv_dtype=a.kv_dtype, **spec)
        _free_memory()  # what is left of transformers' copy
        loaded = self.llm.loaded
        self.device, self.dtype, self.vocab = loaded.device, loaded.dtype, loaded.tokenizer.vocab_size
        self.model_dir = loaded.model_dir
        self.common = {"model": model, "device": str(loaded.device), "kv_dtype": a.kv_dtype,
                       "dtype": str(loaded.dtype).replace("torch.", ""), "host": platform.node()}
        if weights is not None:
            self.common["weights"] = "random, built in device memory"

    def unload(self) -> None:
        self.llm = self.hf = None
        _free_memory()

    def bandwidth(self) -> None:
        if self.device.type != "cuda":
            return
        self.copy_bw = bw.copy_bandwidth(self.device)
        self.emit({"figure": "copy_bandwidth", "gb_s": self.copy_bw / 1e9, **self.common})

    def _decode_work(self, c: int, output_len: int, prompt_len: int | None = None):
        a = self.args
        prompt_len = prompt_len or a.decode_prompt_len
        # other lengths than the longest draw other prompts (no shared prefixes between runs)
        seed = a.seed + c + (0 if prompt_len == a.decode_prompt_len else prompt_len)
        return fixed_workload(c, prompt_len, output_len, self.vocab, seed)

    def decode(self, levels: list[int]) -> None:
        a, engine = self.args, self.llm.engine
        kv_tok = bw.kv_bytes_per_token(engine)
        modes = {"on": [True], "off": [False], "both": [True, False]}[a.decode_ahead]
        runs = [(n, c, ahead) for n in a.decode_prompt_lens for c in levels for ahead in modes]
        for prompt_len, c, ahead in runs:
            engine.set_decode_ahead(ahead and engine.device.type == "cuda")
            work = self._decode_work(c, a.decode_output_len, prompt_len)
            ours = ninfer_runs.decode_throughput(engine, work, synthetic=a.synthetic_context,
                                                 presets=a.sampling == "presets")
            record = {"figure": "decode", "engine": "ninfer", "concurrency": c, "decode_ahead": engine.decode_ahead,
                      "prompt_len": prompt_len, "sampling": a.sampling, **self.common, **ours}
            if a.synthetic_context:
                record["context"] = "synthetic (no prefill)"
            mean_ctx = prompt_len + a.decode_output_len / 2
            weights = bw.weight_bytes_read_per_step(engine.model, c)
            state = bw.state_bytes_per_step(engine.model, c)
            step_bytes = weights + kv_tok * mean_ctx * c + state
            record.update(weight_bytes_per_step=weights, state_bytes_per_step=state, bytes_per_step=step_bytes)
            if self.copy_bw and ours["step_ms"]:
                record["bandwidth_utilisation"] = bw.utilisation(step_bytes, 1000 / ours["step_ms"], self.copy_bw)
            replay = graph_replay_ms(engine, c)
            if replay is not None:
                # the forward alone, replayed on whatever the graph's inputs last held (the
                # run's final step): a floor for models whose cost depends on the inputs
                # (MoE routing, recurrent state that padding rows skip), not their step time
                record["graph_replay_ms"] = replay
                record["graph_head"] = engine.runner.graphs.has_head(engine.runner.graphs.bucket_for(c))
            self.emit(record)
        engine.set_decode_ahead(modes[0] and engine.device.type == "cuda")

    def spec_cost(self, acceptance: list[float], source: str = "given") -> None:
        """The cost of one speculative round at each ``--spec-context`` (see :mod:`ninfer.bench.spec_cost`),
        and the speedup it implies at ``acceptance`` (conditional rates; ``source``: where they came from)."""
        from ninfer.bench.spec_cost import round_cost
        from ninfer_kernels.decode_attention import FUSED_VERIFY

        a = self.args
        for context in a.spec_context:
            record = round_cost(self.llm.engine, context, acceptance, self.vocab)
            self.emit({"figure": "spec_round_cost", "engine": "ninfer", "spec": a.spec,
                       "lm_head_draft": a.lm_head_draft, "fused_verify": FUSED_VERIFY, **self.common, **record,
                       "acceptance_source": source})

    def spec_decode(self, model: str, levels: list[int], ks: list[int]) -> None:
        """Decode at each concurrency without speculation, then with each draft count in
        ``ks``, on the same sample of prompts (:mod:`ninfer.bench.spec_decode`): tok/s,
        tokens per round, per-position acceptance and the speedup."""
        from ninfer.bench import spec_decode

        a = self.args
        plain: dict[int, float] = {}
        for k in [0, *ks]:
            self.load(model, levels, [], offline=False, draft_tokens=k)
            engine = self.llm.engine
            ids = spec_decode.prompt_ids(self.llm.get_tokenizer(), a.spec_prompts)
            for c in levels:
                ours, s = spec_decode.measure(engine, ids, c, a.decode_prompt_len, a.decode_output_len, self.vocab,
                                              a.seed)
                record = {"figure": "spec_decode", "engine": "ninfer", "spec": a.spec if k else None,
                          "draft_tokens": k, "lm_head_draft": a.lm_head_draft if k else None, "concurrency": c,
                          "sample": "random tokens" if ids is None else "text", **self.common, **ours}
                if k:
                    record.update(tokens_per_round=s.acceptance_length, position_acceptance=s.position_acceptance,
                                  speedup=ours["decode_tok_s"] / plain[c] if plain.get(c) else None)
                else:
                    plain[c] = ours["decode_tok_s"]
                self.emit(record)
                if not k and ids is not None:
                    # the plain engine again on random-token prompts pooled the same way: the
                    # single-prompt `decode` figure has stepped faster than the text sample's
                    # peer on the GPU (sessions 34 and 36, 11%), and this tells the text from
                    # the pooling
                    other, _ = spec_decode.measure(engine, None, c, a.decode_prompt_len, a.decode_output_len,
                                                   self.vocab, a.seed)
                    self.emit({**record, **other, "sample": "random tokens"})
        self.unload()

    def prefill(self, lengths: list[int]) -> None:
        for n in lengths:
            ours = ninfer_prefill(self.llm.engine, self._prefill_prompts(n), self.device)
            self.emit({"figure": "prefill", "engine": "ninfer", **self.common, **ours})

    def _prefill_prompts(self, n: int) -> list[list[int]]:
        return [random_workload(1, (n, n), (1, 1), self.vocab, self.args.seed + i).prompts[0] for i in range(3)]

    def _offline_work(self):
        a = self.args
        return random_workload(a.num_requests, a.input_len, a.output_len, self.vocab, a.seed)

    def offline(self) -> None:
        a = self.args
        # a short untimed run compiles every prefill kernel shape first
        warm = random_workload(4, a.input_len, (4, 4), self.vocab, a.seed + 99)
        ninfer_runs.offline_throughput(self.llm.engine, warm)
        ours = ninfer_runs.offline_throughput(self.llm.engine, self._offline_work())
        self.emit({"figure": "offline_throughput", "engine": "ninfer", "requests": a.num_requests,
                   "max_num_seqs": self.llm.profile.engine.max_concurrency, **self.common, **ours})

    # -- transformers, after ours -------------------------------------------------
    def baseline(self, model: str, dynamic: list[int], compiled: list[int], prefill_lens: list[int],
                 offline: bool) -> None:
        """transformers on the same weights (rebuilt from the same config and seed for
        ``random:`` shapes), running the workloads our figures ran; frees our engine first."""
        a = self.args
        self.unload()
        shape = random_weights.shape_of(model)
        if shape is not None:
            self.hf = random_weights.build_hf(shape, self.dtype, self.device, a.seed)
        else:
            self.hf = hf_runs.load_hf(self.model_dir, self.dtype, self.device)
        # compiled runs last: transformers' compile captures graphs of its own
        for setup, wanted in (("dynamic", dynamic), ("compiled", compiled)):
            for c in wanted:
                work = self._decode_work(c, a.hf_decode_output_len or a.decode_output_len)
                theirs = hf_runs.decode_throughput(self.hf, work, self.device, setup)
                self.emit({"figure": "decode", "engine": "transformers", "concurrency": c, **self.common, **theirs})
        for n in prefill_lens:
            theirs = hf_prefill(self.hf, self._prefill_prompts(n), self.device)
            self.emit({"figure": "prefill", "engine": "transformers", **self.common, **theirs})
        if offline:
            theirs = hf_runs.offline_throughput(self.hf, self._offline_work(), a.hf_batch, self.device)
            self.emit({"figure": "offline_throughput", "engine": "transformers", "requests": a.num_requests,
                       "batch": a.hf_batch, **self.common, **theirs})
        self.unload()
