"""Builds a ready engine from a resolved profile: device, model, tokenizer, then the
engine's parts (:mod:`ninfer.engine.parts`), then the engine from them, then warm-up."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
from loguru import logger

from ninfer.engine.compile_watch import process_watch
from ninfer.engine.config import EngineConfig
from ninfer.engine.context_cache import DescriptorLimits
from ninfer.engine.cuda_graph import can_capture, capture_decode_graphs
from ninfer.engine.defaults import ProcessSamplingOverrides
from ninfer.engine.gemm_setup import prefer_matmuls_without_workspace
from ninfer.engine.guided_setup import GuidedDecoding, build_guided_decoding
from ninfer.engine.llm_engine import LLMEngine
from ninfer.engine.parts import (
    EngineParts, KVPool, allocate_kv_pool, allocate_recurrent_state, build_host_kv, context_costs, prefix_reuse_on,
    snapshot_rows, state_pool_bytes,
)
from ninfer.engine.scheduler import step_token_budget
from ninfer.engine.spec.proposer import ProposerContext
from ninfer.engine.spec.device_rounds import DeviceRounds, device_rounds_enabled
from ninfer.engine.spec.verify_graphs import VerifyGraphs
from ninfer.engine.state_slots import RecurrentState
from ninfer.engine.warmup import keep_autotuning_results, warm_up
from ninfer.model.loader import load_model
from ninfer.model.sources import public_id, resolve_source
from ninfer.profile.schema import canonical_dtype
from ninfer.tokenizer import Tokenizer

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass
class LoadedEngine:
    engine: LLMEngine
    tokenizer: Tokenizer
    family: object
    model_config: dict
    model_dir: str
    model_id: str
    device: torch.device
    dtype: torch.dtype


def resolve_device(value) -> torch.device:
    """Profile ``engine.device``: a CUDA index, "cuda" or "cpu"; CPU when CUDA is absent."""
    if str(value) == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu")
    if str(value) == "cuda":
        return torch.device("cuda", 0)
    return torch.device("cuda", int(value))


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """Profile ``dtype`` (or another spelling of one, such as bfloat16) on ``device``."""
    name = canonical_dtype(name)  # callers outside the profile (ninfer-bench) may pass vLLM's names
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[name]


def kv_bytes_per_token(kv_format, specs, dtype: torch.dtype) -> float:
    """Device bytes one token takes across every cached layer (keys, values, scales)."""
    return sum(kv_format.bytes_per_token(dtype, s.num_kv_heads, s.head_dim) for s in specs)


#: device bytes a step's activations take a token, beside the KV pool. Measured peaks over
#: the allocator's resting use in 8,192-token prefill chunks: 146 KiB a token on the
#: 35B-A3B, 175 KiB on the 27B (H100, session 31; scripts/gpu_chunk_latency.py)
ACTIVATION_BYTES_PER_TOKEN = 256 << 10


def activation_headroom(step_tokens: int) -> int:
    """Device memory the KV sizing leaves free for a step of ``step_tokens`` tokens (a
    prefill chunk beside every decode row): 1 GiB at least, for the allocator's slack."""
    return max(1 << 30, step_tokens * ACTIVATION_BYTES_PER_TOKEN)


def kv_capacity_tokens(profile, kv_format, model, dtype, device, draft_specs=(), backend=None) -> int:
    """Tokens the KV pool holds: the profile's number, or with ``auto`` what the device's
    free memory leaves after the recurrent-state pool (``backend``: the speculative one)."""
    value = profile.engine.kv_capacity
    if value != "auto":
        return int(value)
    specs = [*model.attention_specs(), *draft_specs]
    per_token = kv_bytes_per_token(kv_format, specs, dtype)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        # headroom for a step's activations (activation_headroom); hybrid families' recurrent
        # state pool (one slot per admitted request, the snapshot rows and, with
        # speculation, per-position verify rows) is allocated after the KV pool
        width = profile.speculative.draft_tokens + 1 if profile.speculative.backend else 0
        # rounds on the device launched ahead while snapshots are taken use two scratch banks
        # (allocate_recurrent_state); counted whenever they may come, as graphs may be captured
        banks = 2 if (backend is not None and backend.drafts_on_device and device_rounds_enabled()
                      and profile.engine.decode_ahead and profile.engine.prefix_reuse) else 1
        rows = profile.engine.max_concurrency * (1 + banks * width) + (profile.cache.device_state_slots or 0)
        drafts = profile.speculative.draft_tokens if profile.speculative.backend else 0
        step = step_token_budget(profile.engine.prefill_chunk, profile.engine.max_concurrency, drafts)
        budget = free - activation_headroom(step) - state_pool_bytes(model, rows)
        return max(profile.engine.max_context, int(budget // per_token))
    return profile.engine.max_context * profile.engine.max_concurrency


def descriptor_limits(cache) -> DescriptorLimits:
    """The profile's checkpoint limits (unset without prefix reuse, where none are kept)."""
    given = {"private_continuations": cache.max_private_continuations, "shared_prefixes": cache.max_shared_prefixes,
             "anchors_per_continuation": cache.max_long_anchors_per_continuation}
    return DescriptorLimits(**{k: v for k, v in given.items() if v is not None})


def engine_config(profile, kv_tokens: int) -> EngineConfig:
    s = profile.sampling
    return EngineConfig(
        max_context=profile.engine.max_context,
        kv_capacity_tokens=kv_tokens,
        max_concurrency=profile.engine.max_concurrency,
        prefill_chunk=profile.engine.prefill_chunk,
        block_size=profile.engine.block_size,
        prefix_reuse=profile.engine.prefix_reuse,
        default_max_tokens=profile.engine.default_max_tokens,
        thinking=profile.reasoning.thinking,
        kv_dtype=profile.engine.kv_dtype,
        draft_tokens=profile.speculative.draft_tokens or 0 if profile.speculative.backend else 0,
        device_state_slots=profile.cache.device_state_slots,
        host_state_slots=profile.cache.host_state_slots,
        host_kv_mib=profile.cache.host_kv_mib,
        descriptor_limits=descriptor_limits(profile.cache),
        context_cost_presets=profile.engine.context_cost_presets,
        process_sampling=ProcessSamplingOverrides(
            temperature=s.temperature,
            top_p=s.top_p,
            top_k=s.top_k,
            min_p=s.min_p,
            presence_penalty=s.presence_penalty,
            frequency_penalty=s.frequency_penalty,
            seed=s.seed,
            greedy=s.greedy,
        ),
    )


def build_engine(profile, registry, weights=None, *, decode_ahead_on_cpu: bool = False) -> LoadedEngine:
    """Load everything the profile names; raises before allocating on bad selections.

    ``weights`` (name, tensor) pairs stand in for the checkpoint's files (see ``load_model``).
    ``decode_ahead_on_cpu`` runs the decode-ahead path on CPU as well, where it is merely
    synchronous (the tests check that path there); on CUDA the profile alone decides."""
    kv_format = registry.get("kv_dtype", profile.engine.kv_dtype, key="engine.kv_dtype")
    device = resolve_device(profile.engine.device)
    dtype = resolve_dtype(profile.dtype, device)
    prefer_matmuls_without_workspace(device)  # before the first matmul reads the setting
    watch = None
    if device.type == "cuda":
        keep_autotuning_results()  # before the first kernel autotunes
        watch = process_watch()  # counts this engine's compiles; quiet until its warm-up ends
        if watch is not None:
            watch.serving = False
    started = time.perf_counter()
    if weights is None:
        model_dir, weights = resolve_source(profile.model, registry, dtype, device)
    else:  # the caller brings the tensors; the reference is then the directory of the config
        model_dir = Path(profile.model)
    model, config, family = load_model(model_dir, registry, dtype, device, max_context=profile.engine.max_context,
                                       weights=weights)
    tokenizer = Tokenizer.from_pretrained(model_dir)
    logger.info("loaded {} ({}) in {:.1f} s", model_dir, family.name, time.perf_counter() - started)
    presets = family.presets(config) if family.presets else None
    spec = profile.speculative.backend
    backend = registry.get("speculative_backend", spec, key="speculative.backend") if spec else None
    draft_specs = backend.attention_specs(model) if backend is not None and backend.attention_specs else ()
    kv_tokens = kv_capacity_tokens(profile, kv_format, model, dtype, device, draft_specs, backend)
    cfg = engine_config(profile, kv_tokens)
    # multimodal checkpoints (Qwen3.5/3.6) keep the text model's settings in text_config
    vocab_size = int(config.get("vocab_size") or config["text_config"]["vocab_size"])
    guided = build_guided_decoding(profile, registry, tokenizer, family, vocab_size)
    parts = engine_parts(profile, model, family, cfg, kv_format, dtype, device, guided, decode_ahead_on_cpu, backend,
                         vocab_size, Path(model_dir))
    engine = LLMEngine(model, tokenizer, cfg, parts, presets, device, vocab_size)
    if device.type == "cuda":
        warm_up(engine, watch=watch)  # Triton compiles now rather than inside the first requests
    model_id = profile.model_id or default_model_id(profile.model, model_dir)
    return LoadedEngine(engine, tokenizer, family, config, str(model_dir), model_id, device, dtype)


def engine_parts(
    profile, model, family, cfg: EngineConfig, kv_format, dtype: torch.dtype, device: torch.device,
    guided: Optional[GuidedDecoding] = None, decode_ahead_on_cpu: bool = False, speculative=None,
    vocab_size: int = 0, model_dir: Optional[Path] = None,
) -> EngineParts:
    """The engine's pieces, in the order they take device memory: the KV pool, the
    recurrent-state pool (hybrid families), then the decode graphs captured over both."""
    draft_specs = speculative.attention_specs(model) if speculative is not None and speculative.attention_specs else ()
    kv = allocate_kv_pool(model, kv_format, cfg, dtype, device, draft_specs)
    costs = context_costs(model, cfg, device, (family.name, profile.model_id or "", profile.model or ""))
    use_graphs = profile.engine.cuda_graph and device.type == "cuda"
    if use_graphs and not kv.capturable:
        logger.warning("decode runs eagerly: kv_dtype {} has no CUDA-graph-safe kernels yet", cfg.kv_dtype)
        use_graphs = False
    launch_ahead = profile.engine.decode_ahead and (device.type == "cuda" or decode_ahead_on_cpu)
    # greedy rounds run whole on the device: captured on CUDA, eagerly on CPU where tests run
    # them; NINFER_DEVICE_ROUNDS=0 keeps every round on the host (for comparisons)
    device_rounds = (speculative is not None and speculative.drafts_on_device and cfg.draft_tokens > 0
                     and device_rounds_enabled()
                     and (use_graphs and can_capture(model) or device.type == "cpu" and decode_ahead_on_cpu))
    state = allocate_recurrent_state(model, cfg, device, costs, device_rounds=device_rounds and launch_ahead)
    host_kv = build_host_kv(kv, cfg, prefix_reuse_on(cfg, state))
    _log_memory_ledger(model, kv, state, cfg, device)
    graphs, proposer, verify_graphs, rounds = _graph_sets(
        profile, model, family, cfg, kv, state, device, use_graphs, device_rounds, speculative, vocab_size, model_dir)
    # queue each decode step behind the previous one (on CPU nothing would overlap); a
    # speculative round needs its verdict on the host before the next one is proposed,
    # unless it runs whole on the device
    ahead = launch_ahead and (proposer is None or rounds is not None)
    return EngineParts(kv, state, host_kv, guided, graphs, ahead, proposer, verify_graphs, costs, rounds)


def _graph_sets(profile, model, family, cfg: EngineConfig, kv, state, device, use_graphs: bool, device_rounds: bool,
                speculative, vocab_size: int, model_dir):
    """The decode graphs, the proposer (its own graphs with it), the verify graphs and the
    device rounds, each captured as far as the engine uses them."""
    graphs = None
    if use_graphs:
        graphs = capture_decode_graphs(model, cfg.max_concurrency, cfg.max_context, cfg.block_size, device)
        if graphs is None:
            logger.info("decode runs eagerly: the {} family cannot be captured in CUDA graphs", family.name)
    proposer = None
    if speculative is not None:  # a ninfer.capabilities.SpeculativeBackend
        proposer = speculative.factory(ProposerContext(model, profile, cfg, kv.draft_caches, device, vocab_size,
                                                       model_dir, cuda_graphs=use_graphs))
        logger.info("speculative decoding: {} proposes up to {} tokens per round", speculative.name, cfg.draft_tokens)
    verify_graphs = None
    if proposer is not None and graphs is not None:
        verify_graphs = VerifyGraphs(model, cfg.max_concurrency, cfg.draft_tokens + 1, cfg.max_context,
                                     cfg.block_size, device, state.scratch if state is not None else None)
        verify_graphs.capture()
    rounds = None
    if device_rounds and (verify_graphs is not None or device.type == "cpu"):
        rounds = _device_rounds(model, cfg, device, proposer, verify_graphs, state)
    return graphs, proposer, verify_graphs, rounds


def _device_rounds(model, cfg: EngineConfig, device, proposer, verify_graphs, state) -> DeviceRounds:
    """Greedy rounds run whole on the device, the proposer drafting there: captured over
    the verify graphs' inputs on CUDA, run eagerly on CPU (tests)."""
    scratch = state.scratch if state is not None else None
    base = verify_graphs or VerifyGraphs(model, cfg.max_concurrency, cfg.draft_tokens + 1, cfg.max_context,
                                         cfg.block_size, device, scratch)
    rounds = DeviceRounds(model, base, proposer.draft_after_round, scratch)
    if verify_graphs is not None:
        rounds.capture()
    return rounds


def _size(nbytes: float) -> str:
    return f"{nbytes / (1 << 30):.2f} GiB" if nbytes >= 1 << 30 else f"{nbytes / (1 << 20):.1f} MiB"


def _log_memory_ledger(model, kv: KVPool, state: Optional[RecurrentState], cfg: EngineConfig, device) -> None:
    """One line saying where the device memory went: weights, KV pages, recurrent state."""
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    kv_tokens = kv.num_blocks * cfg.block_size
    num_slots = state.slots.num_slots if state is not None else 0
    snap = snapshot_rows(cfg) if state is not None else 0
    snapshots = f", state snapshots {_size(state_pool_bytes(model, snap))} ({snap} rows)" if snap else ""
    free = f", {_size(torch.cuda.mem_get_info(device)[0])} still free" if device.type == "cuda" else ""
    per_token = kv.nbytes / max(kv_tokens, 1)  # every cached layer's keys, values and scales
    logger.info(
        "memory: weights {}, KV {} as {} ({} tokens in pages of {}; {:.0f} bytes a token, {:,.0f} tokens per GiB), "
        "recurrent state {} ({} slots){}{}",
        _size(weights), _size(kv.nbytes), cfg.kv_dtype, kv_tokens, cfg.block_size, per_token, (1 << 30) / per_token,
        _size(state_pool_bytes(model, num_slots)), num_slots, snapshots, free,
    )


def default_model_id(model: str, model_dir) -> str:
    """The public id when --model-id is absent (see :func:`ninfer.model.sources.public_id`)."""
    return public_id(model, Path(model_dir))
