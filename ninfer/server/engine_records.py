"""The engine-wide events of the JSONL request log: server_start and throughput.

server_start says what this process serves and with which capacities, so a campaign
file that several runs append to stays self-describing; throughput carries one
interval's raw counters (deltas), the engine thread's time split (each segment once,
see :mod:`ninfer.engine.exposure`) and end-of-interval gauges. The API key never
appears: argv and the profile carry ``<redacted>`` in its place.
"""

from __future__ import annotations

import os
import platform
from dataclasses import asdict
from typing import Any, Optional, Sequence

import attrs

from ninfer import __version__
from ninfer.engine.exposure import per
from ninfer.engine.stats import ContextCacheCounters, IntervalStats
from ninfer.profile.load import to_dict
from ninfer.profile.rules import REDACTED

_API_KEY_FLAG = "--api-key"


def redacted_argv(argv: Sequence[str], api_key: Optional[str]) -> list[str]:
    """``argv`` with the API key's value replaced, however it was spelled (``--api-key K``,
    ``--api-key=K``, an abbreviation argparse accepts) or wherever else it appears."""
    out, hide_next = [], False
    for arg in argv:
        name, eq, _ = arg.partition("=")
        flag = name.startswith("--a") and _API_KEY_FLAG.startswith(name)
        if hide_next:
            out.append(REDACTED)
        elif flag and eq:
            out.append(f"{name}={REDACTED}")
        elif api_key and api_key in arg:
            out.append(arg.replace(api_key, REDACTED))
        else:
            out.append(arg)
        hide_next = flag and not eq and not hide_next
    return out


def _device(device: Any) -> dict[str, Any]:
    import torch

    out: dict[str, Any] = {"type": device.type, "torch": torch.__version__, "cuda_runtime": torch.version.cuda}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        out.update(index=device.index, name=props.name, total_bytes=props.total_memory,
                   capability=f"{props.major}.{props.minor}",
                   visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"))
    return out


def server_start_fields(state: Any, loaded: Any, argv: Sequence[str]) -> dict[str, Any]:
    """Identity, capacities, sampler defaults, reasoning defaults, memory and environment."""
    profile, engine = state.profile, loaded.engine
    e, c, s, r = profile.engine, profile.cache, profile.speculative, profile.reasoning
    bm, host_kv = engine.block_manager, engine.block_manager.host_kv
    snapshots = engine.scheduler.snapshots
    presets = engine.presets
    return {
        "ninfer_version": __version__,
        "pid": os.getpid(),
        "python": platform.python_version(),
        "argv": redacted_argv(argv, profile.server.api_key),
        "model": {
            "reference": profile.model, "model_id": state.model_id, "path": loaded.model_dir,
            "family": getattr(loaded.family, "name", None), "dtype": str(loaded.dtype).removeprefix("torch."),
            "architectures": loaded.model_config.get("architectures"),
            "model_type": loaded.model_config.get("model_type"), "vocab_size": engine.vocab_size,
            "loras": list(state.loras),
        },
        "engine": {
            "max_context": e.max_context, "kv_capacity_tokens": bm.num_blocks * bm.block_size,
            "kv_blocks": bm.num_blocks, "block_size": bm.block_size, "kv_dtype": e.kv_dtype,
            "max_concurrency": e.max_concurrency, "max_pending_requests": profile.server.max_pending_requests,
            "pending_timeout_ms": profile.server.pending_timeout_ms, "prefill_chunk": e.prefill_chunk,
            "default_max_tokens": e.default_max_tokens, "cuda_graph": e.cuda_graph,
            "decode_ahead": engine.decode_ahead,
        },
        "context_cache": {
            "prefix_reuse": bm.enable_prefix_reuse,
            "device_state_slots": c.device_state_slots, "host_state_slots": c.host_state_slots,
            "host_kv_mib": c.host_kv_mib,
            "host_kv_capacity_pages": host_kv.capacity if host_kv is not None else None,
            "host_kv_page_bytes": host_kv.page_bytes if host_kv is not None else None,
            "state_snapshot_rows": {"device": snapshots.num_device, "host": snapshots.num_host}
            if snapshots is not None else None,
            "max_private_continuations": c.max_private_continuations,
            "max_shared_prefixes": c.max_shared_prefixes,
            "max_long_anchors_per_continuation": c.max_long_anchors_per_continuation,
            "context_cost_source": bm.costs.source,
        },
        "speculative": {"backend": s.backend, "draft_tokens": s.draft_tokens if s.backend else None,
                        "lm_head_draft": s.lm_head_draft},
        "sampling": {
            "presets": {"thinking": asdict_attrs(presets.thinking), "non_thinking": asdict_attrs(presets.non_thinking)}
            if presets is not None else None,
            "process_overrides": attrs.asdict(engine.config.process_sampling),
        },
        "reasoning": {"thinking": r.thinking, "preserve_thinking": r.preserve_thinking,
                      "default_thinking_budget": r.default_thinking_budget},
        "memory": {"kv_bytes": engine.kv_bytes,
                   "host_kv_allocated_bytes": host_kv.allocated_bytes if host_kv is not None else 0,
                   "state_snapshot_host_bytes": snapshots.host_bytes if snapshots is not None else 0},
        "device": _device(loaded.device),
        "profile": to_dict(profile),  # the API key redacted
    }


def asdict_attrs(obj: Any) -> dict[str, Any]:
    return attrs.asdict(obj) if attrs.has(type(obj)) else asdict(obj)


def throughput_fields(s: IntervalStats, engine: Any, before: ContextCacheCounters, now: ContextCacheCounters,
                      in_flight: int) -> dict[str, Any]:
    """One interval: token and step counters, cache deltas, host work, and end-of-interval gauges."""
    w = s.host_work
    sched, bm = engine.scheduler, engine.block_manager
    snapshots = sched.snapshots
    deltas = {k: v - getattr(before, k) for k, v in asdict(now).items() if k != "host_pages"}
    speculative = None
    if engine.proposer is not None:
        speculative = {"rounds": s.rounds, "drafted_tokens": s.drafted, "accepted_tokens": s.accepted,
                       "reached_per_position": list(s.reached), "accepted_per_position": list(s.kept)}
    return {
        "interval_seconds": s.seconds,
        "tokens": {"prefill": s.prefill_tokens, "decode": s.decode_tokens},
        "steps": s.steps,
        "decode_rounds": {"rounds": s.decode_steps, "row_rounds": s.decode_rows,
                          "average_size": per(s.decode_rows, s.decode_steps)},
        "finished_requests": s.finished,
        "speculative": speculative,
        "context_cache": {
            **deltas,
            "occupancy": {"used_pages": bm.num_used_blocks, "cached_pages": bm.num_cached_blocks,
                          "total_pages": bm.num_blocks, "host_pages": now.host_pages,
                          "state_snapshots": len(snapshots) if snapshots is not None else 0,
                          "private_continuations": bm.context.num_continuations if bm.context is not None else 0,
                          "shared_prefixes": bm.context.num_shared if bm.context is not None else 0},
        },
        "host_work": {
            "elapsed_seconds": {"submit": w.submit, "commit": w.commit, "requests": w.requests, "publish": w.publish,
                                "total": w.host_total},
            "device_wait_seconds": w.device_wait,
            "work_class_seconds": {
                "decode": {"host": w.decode_host, "device_wait": w.decode_device_wait},
                "prefill": {"host": w.prefill_host, "device_wait": w.prefill_device_wait},
                "control": {"host": w.requests + w.publish},
            },
            "invocations": {"decode_steps": w.decode_steps, "prefill_steps": w.prefill_steps,
                            "request_jobs": w.request_jobs, "publishes": w.publishes},
            "per_step_host_seconds": per(w.submit + w.commit, w.decode_steps + w.prefill_steps),
            "per_decode_row_round_host_seconds": per(w.decode_host, s.decode_rows),
        },
        "scheduler": {
            "running": sched.num_running, "prefilling": sched.num_prefilling,
            "decode_ready": sched.num_decode_ready, "waiting": sched.num_waiting,
            "kv_usage": bm.usage(), "requests_in_flight": in_flight,
        },
    }
