"""The figures ``ninfer-bench`` prints, each one JSON line per engine and setup."""

from __future__ import annotations

import gc
import platform
from typing import Callable

import torch

from ninfer.bench import bandwidth as bw
from ninfer.bench import hf_runs, ninfer_runs
from ninfer.bench.prefill import hf_prefill, ninfer_prefill
from ninfer.bench.workload import fixed_workload, random_workload


def _resolve_random(model: str, device: str, dtype: str) -> str:
    """``random:SHAPE`` -> a cached full-size random checkpoint (built on first use)."""
    if not model.startswith("random:"):
        return model
    from ninfer.bench.random_checkpoint import make_random_checkpoint
    from ninfer.engine.builder import resolve_device, resolve_dtype
    from ninfer.tiny.cache import cache_root

    shape = model.split(":", 1)[1]
    dev = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, dev)
    out = cache_root().parent / "random" / f"{shape}-{str(torch_dtype).replace('torch.', '')}"
    return str(make_random_checkpoint(out, shape, torch_dtype, dev))


def _graph_replay_ms(engine, batch: int, repeats: int = 50) -> float | None:
    """Milliseconds one replay of the decode graph for ``batch`` rows takes back to back,
    i.e. the forward pass without any host work between steps."""
    graphs = engine.runner.graphs
    bucket = graphs.bucket_for(batch) if graphs is not None else None
    if bucket is None:
        return None
    return bw.cuda_ms(lambda: graphs.replay(bucket), repeats)


class Bench:
    """Holds one loaded model (ours, and transformers' unless skipped) at a time."""

    def __init__(self, args, emit: Callable[[dict], None]):
        self.args, self.emit = args, emit
        self.llm = self.hf = None
        self.copy_bw: float | None = None

    def load(self, model: str, decode_levels: list[int], prefill_lens: list[int], offline: bool,
             transformers: bool) -> None:
        from ninfer import LLM

        a = self.args
        self.llm = self.hf = None
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        longest = max([a.input_len[1] + a.output_len[1], a.decode_prompt_len + a.decode_output_len]
                      + [n + 1 for n in prefill_lens])
        max_seqs = max([a.max_concurrency] + decode_levels)
        # KV for the largest decode batch, a whole offline run at its longest, or one long prompt
        kv = max(longest, (a.decode_prompt_len + a.decode_output_len) * max(decode_levels or [1]),
                 a.num_requests * (a.input_len[1] + a.output_len[1]) if offline else 0)
        path = _resolve_random(model, a.device, a.dtype)
        device = int(a.device) if a.device.isdigit() else a.device
        self.llm = LLM(path, device=device, dtype=a.dtype, max_num_seqs=max_seqs, max_context=longest,
                       kv_capacity=kv, prefill_chunk=a.prefill_chunk, cuda_graph=not a.no_cuda_graph)
        loaded = self.llm.loaded
        self.device, self.vocab = loaded.device, loaded.tokenizer.vocab_size
        self.common = {"model": model, "device": str(loaded.device),
                       "dtype": str(loaded.dtype).replace("torch.", ""), "host": platform.node()}
        if transformers and not a.no_transformers:
            self.hf = hf_runs.load_hf(loaded.model_dir, loaded.dtype, loaded.device)

    def bandwidth(self) -> None:
        if self.device.type != "cuda":
            return
        self.copy_bw = bw.copy_bandwidth(self.device)
        self.emit({"figure": "copy_bandwidth", "gb_s": self.copy_bw / 1e9, **self.common})

    def decode(self, levels: list[int], hf_dynamic: list[int], hf_compiled: list[int]) -> None:
        a, engine = self.args, self.llm.engine
        weights = bw.weight_bytes_read_per_step(engine.model)
        kv_tok = bw.kv_bytes_per_token(engine)
        modes = {"on": [True], "off": [False], "both": [True, False]}[a.decode_ahead]
        for c, ahead in [(c, ahead) for c in levels for ahead in modes]:
            engine.decode_ahead = ahead and engine.device.type == "cuda"
            work = fixed_workload(c, a.decode_prompt_len, a.decode_output_len, self.vocab, a.seed + c)
            ours = ninfer_runs.decode_throughput(engine, work)
            record = {"figure": "decode", "engine": "ninfer", "concurrency": c, "decode_ahead": engine.decode_ahead,
                      **self.common, **ours}
            if self.copy_bw and ours["step_ms"]:
                mean_ctx = a.decode_prompt_len + a.decode_output_len / 2
                record["bandwidth_utilisation"] = bw.utilisation(weights, kv_tok, mean_ctx, c,
                                                                 1000 / ours["step_ms"], self.copy_bw)
                record["bytes_per_step"] = weights + kv_tok * mean_ctx * c
            replay = _graph_replay_ms(engine, c)
            if replay is not None:
                record["graph_replay_ms"] = replay  # device time of the step's forward alone
            self.emit(record)
        engine.decode_ahead = modes[0] and engine.device.type == "cuda"
        if self.hf is None:
            return
        # transformers after all of ours: its compiled setup recompiles and captures graphs
        # of its own, which should not sit between our timed runs
        for setup, wanted in (("dynamic", hf_dynamic), ("compiled", hf_compiled)):
            for c in [c for c in levels if c in wanted]:
                work = fixed_workload(c, a.decode_prompt_len, a.decode_output_len, self.vocab, a.seed + c)
                theirs = hf_runs.decode_throughput(self.hf, work, self.device, setup)
                self.emit({"figure": "decode", "engine": "transformers", "concurrency": c, **self.common, **theirs})

    def prefill(self, lengths: list[int]) -> None:
        for n in lengths:
            prompts = [random_workload(1, (n, n), (1, 1), self.vocab, self.args.seed + i).prompts[0]
                       for i in range(3)]
            ours = ninfer_prefill(self.llm.engine, prompts, self.device)
            self.emit({"figure": "prefill", "engine": "ninfer", **self.common, **ours})
            if self.hf is not None:
                theirs = hf_prefill(self.hf, prompts, self.device)
                self.emit({"figure": "prefill", "engine": "transformers", **self.common, **theirs})

    def offline(self) -> None:
        a = self.args
        # a short untimed run compiles every prefill kernel shape first
        warm = random_workload(4, a.input_len, (4, 4), self.vocab, a.seed + 99)
        ninfer_runs.offline_throughput(self.llm.engine, warm)
        work = random_workload(a.num_requests, a.input_len, a.output_len, self.vocab, a.seed)
        ours = ninfer_runs.offline_throughput(self.llm.engine, work)
        self.emit({"figure": "offline_throughput", "engine": "ninfer", "requests": a.num_requests,
                   "max_num_seqs": self.llm.profile.engine.max_concurrency, **self.common, **ours})
        if self.hf is not None and not a.no_hf_offline:
            theirs = hf_runs.offline_throughput(self.hf, work, a.hf_batch, self.device)
            self.emit({"figure": "offline_throughput", "engine": "transformers", "requests": a.num_requests,
                       "batch": a.hf_batch, **self.common, **theirs})
