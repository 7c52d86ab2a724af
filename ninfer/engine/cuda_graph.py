"""Decode steps replayed from CUDA graphs.

A decode step of a dense model launches a few hundred small kernels; eagerly, launch
overhead on the host dominates at low concurrency. We capture the model's forward for
decode batches once per batch-size bucket (1, 2, 4, 8, then steps of 8 and 16), all
graphs sharing one memory pool, and replay the smallest bucket that holds the batch.

Graphs read their inputs from static device buffers. The per-row fields (token ids,
positions, context lengths, KV slots and, for models with recurrent state, state slots;
int64) sit at the front of one device staging buffer and *are* the graphs' inputs, so a
step packs them with its block tables into a pinned host buffer and one transfer fills
them; only the block tables are then copied into their own [rows, pages] buffer. Rows
past the batch (padding up to the bucket) get KV slot -1 and state slot -1, so neither
the KV write nor the recurrent layers store anything for them, and a context length of
1, so attention stays cheap and finite there. Two pinned host buffers take turns: a step
launched ahead fills one while the transfer of the step before may still be queued on
the other.

Buckets of up to :data:`HEAD_ROWS` rows (where a step's launches matter most) capture
the LM head and the greedy argmax too, so a step of plain greedy rows is one replay and
a copy of its token ids; other rows sample from the captured logits. Each such bucket
keeps its float32 logits allocated (1 MiB a row at Qwen3.6's 248,320-token vocabulary),
which is why larger buckets leave the head to the eager path, where its launches are
shared by many rows. ``NINFER_GRAPH_HEAD=0`` captures the forward alone (read at capture).

Prefill, mixed steps, LoRA batches and models that do not declare
``supports_cuda_graphs`` run eagerly.
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable, Optional, Sequence, Union

import attrs
import numpy as np
import torch
from loguru import logger

from ninfer.model.forward_batch import ForwardBatch

#: batch sizes captured: small ones one by one (decode at low concurrency is the
#: latency-critical case), then coarser steps
BUCKETS = (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256)
#: buckets of up to this many rows capture the LM head and the greedy argmax as well
HEAD_ROWS = 16


def head_in_graph() -> bool:
    """``NINFER_GRAPH_HEAD=0`` leaves the LM head out of the decode graphs (an A/B peer)."""
    return os.environ.get("NINFER_GRAPH_HEAD", "1") != "0"


@attrs.frozen
class CapturedHead:
    """A replayed bucket's LM head: float32 logits [bucket, vocab] and their argmax [bucket]
    (static graph outputs, overwritten by the bucket's next replay)."""

    logits: torch.Tensor
    greedy_ids: torch.Tensor


def buckets_up_to(max_batch: int) -> list[int]:
    sizes = [b for b in BUCKETS if b < max_batch]
    return sizes + [max_batch]


def can_capture(model) -> bool:
    """Models opt in: their decode forward must be free of host syncs and host-side shapes."""
    return bool(getattr(model, "supports_cuda_graphs", False))


def capture_decode_graphs(
    model, max_batch: int, max_context: int, block_size: int, device: torch.device
) -> Optional["DecodeGraphs"]:
    """Decode graphs captured for ``model`` (its KV caches bound and any state pool
    allocated); None when the device is not CUDA or the model does not opt in."""
    if device.type != "cuda" or not can_capture(model):
        return None
    with_state = model.state_bytes_per_slot() > 0
    graphs = DecodeGraphs(model, max_batch, max_context, block_size, device, with_state)
    graphs.capture()
    return graphs


def _clear_cublas_workspaces() -> None:
    """Drop cuBLAS's cached workspaces so the next capture allocates its own inside the
    graph pool. A graph that captured the shared workspace would keep using that memory
    after anything else (torch.compile's graph trees do) clears the cache and frees it."""
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()


#: the capture stream and memory pool every set of graphs shares on a device (NINFER_GRAPH_SHARE=1)
_SHARED: dict[int, tuple] = {}


def _share() -> bool:
    """``NINFER_GRAPH_SHARE=1``: every set of graphs (decode, verify, rounds; each engine's)
    captured on one stream into one pool per device, as one engine's buckets are. Session 39
    (H100): graphs with PDL replay 13% slower once a second set is captured in the process,
    where one set of eleven buckets does not slow them. Session 40: a second engine captured
    this way leaves both at full speed, but a speculating engine stays slow with it, so it
    is opt-in until that is understood. Session 41: here a third extra graph of any kind
    slows the engine too, and capturing its graphs again restores them
    (scripts/gpu_engine_slowdown.py)."""
    return os.environ.get("NINFER_GRAPH_SHARE", "0") == "1"


def _capture_context(device: torch.device) -> tuple["torch.cuda.Stream", Optional[tuple]]:
    """(stream, pool) for a set of captures: a fresh stream and pool, or the device's shared ones."""
    if _share() and _device_key(device) in _SHARED:
        return _SHARED[_device_key(device)]
    return torch.cuda.Stream(device), None


def _device_key(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


@torch.inference_mode()
def capture_buckets(buckets: Sequence[int], forward: Callable[[int], Any], device: torch.device,
                    what: str) -> tuple[dict[int, "torch.cuda.CUDAGraph"], dict[int, Any]]:
    """One graph of ``forward(bucket)`` per bucket, all in one memory pool (largest first,
    so the later ones fit in its pool); returns the graphs and their static outputs.
    Each bucket runs twice outside the capture first, so every kernel is compiled and warm."""
    sizes = ",".join(map(str, sorted(buckets)))
    # a cold Triton cache compiles the step's kernels here first (12 s for the 27B on an H100)
    logger.info("capturing {} CUDA graphs for batch sizes {}", what, sizes)
    started = time.perf_counter()
    before = torch.cuda.memory_allocated(device)
    graphs: dict[int, torch.cuda.CUDAGraph] = {}
    outputs: dict[int, Any] = {}
    stream, pool = _capture_context(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for bs in sorted(buckets, reverse=True):
            for _ in range(2):
                forward(bs)
            torch.cuda.synchronize(device)
            _clear_cublas_workspaces()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                outputs[bs] = forward(bs)
            pool = graph.pool()
            if _share():
                _SHARED.setdefault(_device_key(device), (stream, pool))
            graphs[bs] = graph
    _clear_cublas_workspaces()
    torch.cuda.current_stream(device).wait_stream(stream)
    torch.cuda.synchronize(device)
    logger.info("captured {} CUDA graphs for batch sizes {} in {:.1f} s ({:.0f} MiB)", what, sizes,
                time.perf_counter() - started, (torch.cuda.memory_allocated(device) - before) / 2**20)
    return graphs, outputs


class StagedInputs:
    """A captured step's integer inputs, sent to the device in one transfer per step
    (decode, speculative verify and MTP drafting graphs all stage through one).

    One int64 buffer on the device holds every named field (the graphs read views of it:
    :meth:`device`) followed by room for ``table_rows`` block-table rows of ``max_blocks``
    entries on their way into an int32 table. A step fills a pinned host copy (two,
    alternating, so the previous step's copy may still be in flight) through numpy views
    (:meth:`host`), then :meth:`send` moves the filled prefix and the table.
    """

    def __init__(self, fields: Sequence[tuple[str, int]], table_rows: int, max_blocks: int, device: torch.device):
        self._offsets: dict[str, int] = {}
        end = 0
        for name, size in fields:
            self._offsets[name] = end
            end += size
        self._sizes = dict(fields)
        self._table_at, self.max_blocks = end, max_blocks
        self._stage = torch.zeros(end + table_rows * max_blocks, dtype=torch.int64, device=device)
        pin = device.type == "cuda"
        self._hosts = [torch.zeros(self._stage.shape, dtype=torch.int64, pin_memory=pin) for _ in range(2)]
        self._turn = 0
        self._current = self._hosts[0]
        self._host = self._current.numpy()
        self.block_tables = torch.zeros(table_rows, max_blocks, dtype=torch.int32, device=device)

    def device(self, name: str) -> torch.Tensor:
        """The device view of field ``name`` (what a graph captures)."""
        lo = self._offsets[name]
        return self._stage[lo : lo + self._sizes[name]]

    def begin(self) -> None:
        """Start filling the next step's host copy."""
        self._current = self._hosts[self._turn]
        self._host = self._current.numpy()
        self._turn ^= 1

    def host(self, name: str, shape) -> np.ndarray:
        """The first ``prod(shape)`` entries of field ``name`` in the host copy, shaped."""
        lo = self._offsets[name]
        return self._host[lo : lo + int(np.prod(shape))].reshape(shape)

    def send(self, table: np.ndarray) -> None:
        """Copy the fields and ``table`` [rows, cols] to the device; the table lands in
        ``block_tables[:rows, :cols]`` (entries past ``cols`` keep stale page ids)."""
        rows, cols = table.shape
        end = self._table_at + rows * cols
        self._host[self._table_at : end] = table.reshape(-1)
        self._stage[:end].copy_(self._current[:end], non_blocking=True)
        self.block_tables[:rows, :cols].copy_(self._stage[self._table_at : end].view(rows, cols))


class DecodeGraphs:
    """One captured decode forward per bucket; :meth:`run` replays the right one."""

    def __init__(
        self, model, max_batch: int, max_context: int, block_size: int, device: torch.device,
        state_slots: bool = False,
    ):
        self.model = model
        self.block_size = block_size
        self.max_context = max_context
        self.device = device
        self.buckets = buckets_up_to(max_batch)
        self.max_blocks = -(-max_context // block_size)
        n = self.buckets[-1]
        i64, i32 = dict(dtype=torch.int64, device=device), dict(dtype=torch.int32, device=device)
        # the graphs' inputs themselves: four or five [n] fields, staged in one transfer
        names = ["input_ids", "positions", "seq_lens", "slot_mapping"] + (["state_slots"] if state_slots else [])
        self._inputs = StagedInputs([(name, n) for name in names], n, self.max_blocks, device)
        self.input_ids, self.positions, self.seq_lens, self.slot_mapping = (self._inputs.device(f) for f in names[:4])
        self.state_slots: Optional[torch.Tensor] = self._inputs.device("state_slots") if state_slots else None
        self.seq_lens.fill_(1)
        self.slot_mapping.fill_(-1)
        if self.state_slots is not None:
            self.state_slots.fill_(-1)
        self.block_tables = self._inputs.block_tables
        self.query_start = torch.arange(n + 1, **i32)
        self.rows = torch.arange(n, **i64)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._hidden: dict[int, torch.Tensor] = {}
        self._heads: dict[int, CapturedHead] = {}
        self._last: Optional[int] = None  # the bucket :meth:`run` replayed last

    def _batch(self, bs: int) -> ForwardBatch:
        """Views of the static buffers for bucket ``bs``; host lists are never read on CUDA."""
        return ForwardBatch(
            query_start=self.query_start[: bs + 1],
            seq_lens=self.seq_lens[:bs],
            block_tables=self.block_tables[:bs],
            slot_mapping=self.slot_mapping[:bs],
            logits_indices=self.rows[:bs],
            block_size=self.block_size,
            # key splits are sized for the longest context; they stay correct for shorter ones
            max_query_len=1,
            max_seq_len=self.max_context,
            query_lens_host=[1] * bs,
            seq_lens_host=[1] * bs,
            state_slots=None if self.state_slots is None else self.state_slots[:bs],
        )

    def capture(self) -> None:
        with_head = head_in_graph()

        def forward(bs: int) -> tuple:
            hidden = self.model(self.input_ids[:bs], self.positions[:bs], self._batch(bs))
            if not with_head or bs > HEAD_ROWS:
                return hidden, None
            logits = self.model.compute_logits(hidden)
            return hidden, CapturedHead(logits, logits.argmax(dim=-1))

        self._graphs, outputs = capture_buckets(self.buckets, forward, self.device, "decode")
        self._hidden = {bs: hidden for bs, (hidden, _) in outputs.items()}
        self._heads = {bs: head for bs, (_, head) in outputs.items() if head is not None}

    def bucket_for(self, num_seqs: int) -> Optional[int]:
        for b in self.buckets:
            if b >= num_seqs:
                return b
        return None

    def replay(self, bucket: int) -> None:
        """Replay bucket ``bucket`` on whatever its static inputs hold (benchmarks time this)."""
        self._graphs[bucket].replay()

    def output(self, bucket: int) -> torch.Tensor:
        """The hidden rows bucket ``bucket`` writes when replayed."""
        return self._hidden[bucket]

    def run(
        self,
        token_ids: Union[Sequence[int], torch.Tensor],
        positions: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        state_slots: Optional[Sequence[int]] = None,
    ) -> torch.Tensor:
        """Replay the decode step of ``len(token_ids)`` sequences, each adding one token at
        ``positions[i]``; returns their hidden rows [B, hidden] (row ``i``: sequence ``i``).
        ``token_ids`` may be a device tensor (a step launched before the previous one's
        tokens reached the host); ``state_slots``: each sequence's recurrent-state slot,
        for graphs captured with state slots."""
        bs = self.stage_inputs(token_ids, positions, block_tables, state_slots)
        self._graphs[bs].replay()
        self._last = bs
        return self._hidden[bs][: len(token_ids)]

    def has_head(self, bucket: int) -> bool:
        """Whether bucket ``bucket`` replays the LM head and its argmax too."""
        return bucket in self._heads

    def last_head(self, rows: int) -> Optional[CapturedHead]:
        """The LM head the last :meth:`run` replayed, cut to its ``rows`` real rows; None
        when that bucket left the head out."""
        head = self._heads.get(self._last) if self._last is not None else None
        return None if head is None else CapturedHead(head.logits[:rows], head.greedy_ids[:rows])

    def stage_inputs(
        self,
        token_ids: Union[Sequence[int], torch.Tensor],
        positions: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        state_slots: Optional[Sequence[int]] = None,
    ) -> int:
        """Fill the static inputs for this batch; returns the bucket to replay."""
        if (state_slots is None) != (self.state_slots is None):
            raise ValueError("state slots must be given exactly when the graphs were captured with them")
        on_device = isinstance(token_ids, torch.Tensor)
        num = len(token_ids)
        bs = self.bucket_for(num)
        assert bs is not None, "batch larger than the largest captured bucket"
        n = self.buckets[-1]
        width = max(len(t) for t in block_tables)
        inputs = self._inputs
        inputs.begin()
        pos = np.fromiter(positions, dtype=np.int64, count=num)
        table = np.zeros((bs, width), dtype=np.int64)
        for i, t in enumerate(block_tables):
            table[i, : len(t)] = t
        ids, pos_f, lens, slots = (inputs.host(name, n) for name in ("input_ids", "positions", "seq_lens",
                                                                      "slot_mapping"))
        ids[:] = 0
        if not on_device:
            ids[:num] = token_ids
        pos_f[:num], pos_f[num:] = pos, 0
        lens[:num], lens[num:] = pos + 1, 1  # context length including the new token
        bsz = self.block_size
        slots[:num] = table[np.arange(num), pos // bsz] * bsz + pos % bsz
        slots[num:] = -1  # padding rows never write KV
        if state_slots is not None:
            held = inputs.host("state_slots", n)
            held[:num], held[num:] = np.fromiter(state_slots, dtype=np.int64, count=num), -1
        inputs.send(table)
        if on_device:
            self.input_ids[:num].copy_(token_ids)
        return bs
