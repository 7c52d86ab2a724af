"""Reference for copying state rows between slots of many pools at once.

A hybrid model keeps its recurrent state as two pools per Gated DeltaNet layer (conv
history and delta-rule matrices), each ``[rows, ...]``. Settling a speculative round and
taking or restoring a prefix-cache snapshot copy whole rows (``src[i]`` to ``dst[i]``) in
every pool: op by op that is two launches per pool and pair, a few hundred per step on
the 27B shape; the Triton version does it in one.
"""

from __future__ import annotations

import torch


def copy_rows(pools: list[torch.Tensor], src: torch.Tensor, dst: torch.Tensor) -> None:
    """In every pool, row ``dst[i]`` takes row ``src[i]`` (int64 [N], same device as the
    pools). The destinations are distinct and none is another pair's source; a pair may
    copy a row onto itself (nothing moves: a device round's padding rows do)."""
    for pool in pools:
        pool.index_copy_(0, dst, pool.index_select(0, src))
