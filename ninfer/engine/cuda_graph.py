"""Decode steps replayed from CUDA graphs.

A decode step of a dense model launches a few hundred small kernels; eagerly, launch
overhead on the host dominates at low concurrency. We capture the model's forward for
decode batches once per batch-size bucket (1, 2, 4, 8, then steps of 8 and 16), all
graphs sharing one memory pool, and replay the smallest bucket that holds the batch.

Graphs read their inputs from static device buffers. Each step packs the batch's
token ids, positions, context lengths, KV slots and block tables into one pinned host
buffer, copies it to the device with a single transfer and scatters it into the static
buffers. Rows past the batch (padding up to the bucket) get KV slot -1, so the KV write
skips them, and a context length of 1, so attention stays cheap and finite there.

Prefill, mixed steps, LoRA batches and models that cannot be captured (host syncs in
their forward, such as MoE routing by expert counts) run eagerly.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Optional, Sequence, Union

import numpy as np
import torch
from loguru import logger

from ninfer.model.forward_batch import ForwardBatch

#: batch sizes captured: small ones one by one (decode at low concurrency is the
#: latency-critical case), then coarser steps
BUCKETS = (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256)


def buckets_up_to(max_batch: int) -> list[int]:
    sizes = [b for b in BUCKETS if b < max_batch]
    return sizes + [max_batch]


def can_capture(model) -> bool:
    """Models opt in: their decode forward must be free of host syncs and host-side shapes."""
    return bool(getattr(model, "supports_cuda_graphs", False))


def _clear_cublas_workspaces() -> None:
    """Drop cuBLAS's cached workspaces so the next capture allocates its own inside the
    graph pool. A graph that captured the shared workspace would keep using that memory
    after anything else (torch.compile's graph trees do) clears the cache and frees it."""
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()


class DecodeGraphs:
    """One captured decode forward per bucket; :meth:`run` replays the right one."""

    def __init__(self, model, max_batch: int, max_context: int, block_size: int, device: torch.device):
        self.model = model
        self.block_size = block_size
        self.max_context = max_context
        self.device = device
        self.buckets = buckets_up_to(max_batch)
        self.max_blocks = -(-max_context // block_size)
        n = self.buckets[-1]
        i64, i32 = dict(dtype=torch.int64, device=device), dict(dtype=torch.int32, device=device)
        self.input_ids = torch.zeros(n, **i64)
        self.positions = torch.zeros(n, **i64)
        self.seq_lens = torch.ones(n, **i32)
        self.slot_mapping = torch.full((n,), -1, **i64)
        self.block_tables = torch.zeros(n, self.max_blocks, **i32)
        self.query_start = torch.arange(n + 1, **i32)
        self.rows = torch.arange(n, **i64)
        # one pinned staging area: four [n] fields, then up to n * max_blocks table entries
        self._host = torch.empty(4 * n + n * self.max_blocks, dtype=torch.int64).pin_memory()
        self._host_np = self._host.numpy()
        self._stage = torch.empty_like(self._host, device=device)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._hidden: dict[int, torch.Tensor] = {}
        self._batches: dict[int, ForwardBatch] = {}

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
        )

    @torch.inference_mode()
    def capture(self) -> None:
        started = time.perf_counter()
        before = torch.cuda.memory_allocated(self.device)
        pool = None
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for bs in reversed(self.buckets):  # largest first, so later graphs fit in its pool
                batch = self._batch(bs)
                ids, pos = self.input_ids[:bs], self.positions[:bs]
                for _ in range(2):  # compile and warm every kernel outside the capture
                    self.model(ids, pos, batch)
                torch.cuda.synchronize(self.device)
                _clear_cublas_workspaces()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    self._hidden[bs] = self.model(ids, pos, batch)
                pool = graph.pool()
                self._graphs[bs], self._batches[bs] = graph, batch
        _clear_cublas_workspaces()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)
        logger.info(
            "captured decode CUDA graphs for batch sizes {} in {:.1f} s ({:.0f} MiB)",
            ",".join(map(str, self.buckets)), time.perf_counter() - started,
            (torch.cuda.memory_allocated(self.device) - before) / 2**20,
        )

    def bucket_for(self, num_seqs: int) -> Optional[int]:
        for b in self.buckets:
            if b >= num_seqs:
                return b
        return None

    def replay(self, bucket: int) -> None:
        """Replay bucket ``bucket`` on whatever its static inputs hold (benchmarks time this)."""
        self._graphs[bucket].replay()

    def run(
        self,
        token_ids: Union[Sequence[int], torch.Tensor],
        positions: Sequence[int],
        block_tables: Sequence[Sequence[int]],
    ) -> tuple[torch.Tensor, ForwardBatch]:
        """Replay the decode step of ``len(token_ids)`` sequences, each adding one token at
        ``positions[i]``; returns (hidden rows [B, hidden], the batch whose
        ``logits_indices`` select them). ``token_ids`` may be a device tensor (a step
        launched before the previous one's tokens reached the host)."""
        on_device = isinstance(token_ids, torch.Tensor)
        num = len(token_ids)
        bs = self.bucket_for(num)
        assert bs is not None, "batch larger than the largest captured bucket"
        width = max(len(t) for t in block_tables)
        h = self._host_np
        pos = np.fromiter(positions, dtype=np.int64, count=num)
        table = np.zeros((bs, width), dtype=np.int64)
        for i, t in enumerate(block_tables):
            table[i, : len(t)] = t
        h[0:bs] = 0
        if not on_device:
            h[0:num] = token_ids
        h[bs : bs + num] = pos
        h[bs + num : 2 * bs] = 0
        h[2 * bs : 2 * bs + num] = pos + 1  # context length including the new token
        h[2 * bs + num : 3 * bs] = 1
        bsz = self.block_size
        h[3 * bs : 3 * bs + num] = table[np.arange(num), pos // bsz] * bsz + pos % bsz
        h[3 * bs + num : 4 * bs] = -1  # padding rows never write KV
        end = 4 * bs + bs * width
        h[4 * bs : end] = table.reshape(-1)
        stage = self._stage[:end]
        stage.copy_(self._host[:end], non_blocking=True)
        self.input_ids[:bs].copy_(stage[0:bs])
        if on_device:
            self.input_ids[:num].copy_(token_ids)
        self.positions[:bs].copy_(stage[bs : 2 * bs])
        self.seq_lens[:bs].copy_(stage[2 * bs : 3 * bs])
        self.slot_mapping[:bs].copy_(stage[3 * bs : 4 * bs])
        self.block_tables[:bs, :width].copy_(stage[4 * bs : end].view(bs, width))
        self._graphs[bs].replay()
        return self._hidden[bs][:num], dataclasses.replace(self._batches[bs], logits_indices=self.rows[:num])
