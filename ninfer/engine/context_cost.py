"""What keeping a cached prefix is worth: recompute cost against transfer cost.

The context cache decides two things with these figures. When a device page (or a
recurrent-state snapshot) has to make room, moving it to the host tier pays only if
copying it out and back costs less than computing its tokens again; and among cached
pages that a checkpoint retains, the one cheapest to recompute per byte freed goes
first. Both need a prefill cost per token, which grows with the context before the
token (attention reads every earlier key), and a host-transfer bandwidth.

The coefficients come from generic defaults estimated from the model's size and the
device type, or from ``--context-cost-presets FILE`` (YAML or JSON), read and checked at
startup. docs/context-cache.md describes the file; in short::

    version: 1
    transfer: {host_gbps: 24.0}            # optional: host <-> device copies, GB/s each way
    prefill:                               # optional: the first entry that matches is used
      - model: qwen3_5                     # substring of the family, model id or reference
        device: H200                       # optional: substring of the device name (cpu on CPU)
        ns_per_token: 95000                # prefill nanoseconds per token at context 0
        ns_per_token_per_ktoken: 160       # extra nanoseconds per token per 1000 tokens of context
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional

import yaml

#: dense matmul throughput assumed by the generic defaults (FLOP per ns): a CPU core pair,
#: and a large GPU at a realistic share of its bf16 peak
GENERIC_FLOPS_PER_NS = {"cpu": 20.0, "cuda": 300_000.0}
#: host <-> device (or host <-> host on CPU) copy bandwidth of the generic defaults, GB/s
GENERIC_TRANSFER_GBPS = {"cpu": 5.0, "cuda": 20.0}
GENERIC_SOURCE = "generic defaults"

_TOP_KEYS = ("version", "transfer", "prefill")
_TRANSFER_KEYS = ("host_gbps",)
_PREFILL_KEYS = ("model", "device", "ns_per_token", "ns_per_token_per_ktoken")


class ContextCostError(ValueError):
    """A presets file that cannot be used; the message names the offending key."""


@dataclass(frozen=True)
class ContextCosts:
    """Resolved coefficients, and where they came from (``source``, for the startup records)."""

    prefill_ns_per_token: float
    #: extra prefill nanoseconds per token for every 1000 tokens of context before it
    depth_ns_per_token_per_ktoken: float
    host_gbps: float
    source: str = GENERIC_SOURCE

    def recompute_ns(self, start: int, tokens: int) -> float:
        """Prefill nanoseconds for ``tokens`` tokens that follow ``start`` tokens of context."""
        mean_depth = start + tokens / 2
        return tokens * (self.prefill_ns_per_token + self.depth_ns_per_token_per_ktoken * mean_depth / 1000)

    def transfer_ns(self, nbytes: int) -> float:
        """Nanoseconds to copy ``nbytes`` one way between device and host (GB/s = bytes/ns)."""
        return nbytes / self.host_gbps

    def spill_pays(self, start: int, tokens: int, nbytes: int) -> bool:
        """Whether copying ``nbytes`` out and back later costs less than recomputing the tokens."""
        return 2 * self.transfer_ns(nbytes) < self.recompute_ns(start, tokens)


#: what a block manager built without an engine (tests, tools) assumes: a mid-size model on a GPU
DEFAULT_COSTS = ContextCosts(prefill_ns_per_token=50_000.0, depth_ns_per_token_per_ktoken=100.0, host_gbps=20.0)


def generic_costs(num_params: int, attention_width: int, device_type: str) -> ContextCosts:
    """Estimates from the model's shape: 2 FLOP per parameter per token, and 4 FLOP per
    attention channel (heads x head dim, summed over layers) per earlier token."""
    kind = "cuda" if device_type == "cuda" else "cpu"
    flops = GENERIC_FLOPS_PER_NS[kind]
    return ContextCosts(
        prefill_ns_per_token=max(2 * num_params / flops, 1.0),
        depth_ns_per_token_per_ktoken=4 * attention_width * 1000 / flops,
        host_gbps=GENERIC_TRANSFER_GBPS[kind],
    )


def _positive(value: Any, key: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ContextCostError(f"{key}: expected a positive number, got {value!r}")
    return float(value)


def _non_negative(value: Any, key: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise ContextCostError(f"{key}: expected a number >= 0, got {value!r}")
    return float(value)


def _mapping(value: Any, key: str, allowed: tuple[str, ...]) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ContextCostError(f"{key}: expected a mapping, got {type(value).__name__}")
    for name in value:
        if name not in allowed:
            raise ContextCostError(f"{key}.{name}: unknown key (expected one of {', '.join(allowed)})"
                                   if key else f"{name}: unknown key (expected one of {', '.join(allowed)})")
    return value


def _text(value: Any, key: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ContextCostError(f"{key}: expected a non-empty string, got {value!r}")
    return value


@dataclass(frozen=True)
class PrefillEntry:
    model: str
    device: Optional[str]
    ns_per_token: float
    ns_per_token_per_ktoken: float

    def matches(self, names: tuple[str, ...], device_name: str) -> bool:
        model = self.model.lower()
        if not any(model in name.lower() for name in names):
            return False
        return self.device is None or self.device.lower() in device_name.lower()


@dataclass(frozen=True)
class CostPresets:
    """A checked presets file."""

    path: str
    host_gbps: Optional[float]
    prefill: tuple[PrefillEntry, ...]

    def resolve(self, generic: ContextCosts, model_names: tuple[str, ...], device_name: str) -> ContextCosts:
        """The generic costs with this file's matching entries laid over them."""
        picked = [(i, e) for i, e in enumerate(self.prefill) if e.matches(model_names, device_name)][:1]
        parts = []
        costs = generic
        if picked:
            i, entry = picked[0]
            costs = ContextCosts(entry.ns_per_token, entry.ns_per_token_per_ktoken, costs.host_gbps)
            parts.append(f"prefill[{i}]")
        if self.host_gbps is not None:
            costs = ContextCosts(costs.prefill_ns_per_token, costs.depth_ns_per_token_per_ktoken, self.host_gbps)
            parts.append("transfer")
        if not parts:
            return ContextCosts(costs.prefill_ns_per_token, costs.depth_ns_per_token_per_ktoken, costs.host_gbps,
                                f"{GENERIC_SOURCE} (no entry of {self.path} matches)")
        return ContextCosts(costs.prefill_ns_per_token, costs.depth_ns_per_token_per_ktoken, costs.host_gbps,
                            f"{self.path} ({', '.join(parts)}; the rest generic)" if len(parts) < 2
                            else f"{self.path} ({', '.join(parts)})")


def parse_presets(data: Any, path: str) -> CostPresets:
    """Check a loaded presets document; raises :class:`ContextCostError` naming the key."""
    top = _mapping(data, "", _TOP_KEYS)
    if top.get("version", 1) != 1:
        raise ContextCostError(f"version: this build reads version 1, got {top.get('version')!r}")
    host_gbps = None
    if top.get("transfer") is not None:
        transfer = _mapping(top["transfer"], "transfer", _TRANSFER_KEYS)
        if "host_gbps" not in transfer:
            raise ContextCostError("transfer.host_gbps: required in a transfer section")
        host_gbps = _positive(transfer["host_gbps"], "transfer.host_gbps")
    entries = []
    prefill = top.get("prefill") or []
    if not isinstance(prefill, list):
        raise ContextCostError(f"prefill: expected a list of entries, got {type(prefill).__name__}")
    for i, raw in enumerate(prefill):
        key = f"prefill[{i}]"
        item = _mapping(raw, key, _PREFILL_KEYS)
        for name in ("model", "ns_per_token"):
            if name not in item:
                raise ContextCostError(f"{key}.{name}: required")
        device = item.get("device")
        entries.append(PrefillEntry(
            model=_text(item["model"], f"{key}.model"),
            device=_text(device, f"{key}.device") if device is not None else None,
            ns_per_token=_positive(item["ns_per_token"], f"{key}.ns_per_token"),
            ns_per_token_per_ktoken=_non_negative(item.get("ns_per_token_per_ktoken", 0), f"{key}.ns_per_token_per_ktoken"),
        ))
    if host_gbps is None and not entries:
        raise ContextCostError("the file sets nothing: give a transfer section, prefill entries, or both")
    return CostPresets(path, host_gbps, tuple(entries))


def load_presets(path: str) -> CostPresets:
    """Read and check ``path`` (JSON when it ends in .json, else YAML)."""
    file = Path(path)
    try:
        text = file.read_text(encoding="utf-8")
    except OSError as exc:
        raise ContextCostError(f"cannot be read: {exc.strerror or exc}") from None
    try:
        data = json.loads(text) if file.suffix.lower() == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        raise ContextCostError(f"not valid {'JSON' if file.suffix.lower() == '.json' else 'YAML'}: {exc}") from None
    return parse_presets(data, path)
