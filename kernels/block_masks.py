"""The FlexAttention masks of a selective pass (kernels): the causal-by-index rule and its block
mask, built straight from the indices.

Rule: key `kv_idx` is visible to query `q_idx` iff `kv_idx <= q_index[q_idx]` (the query's prompt
index), and, on the corrected path, `keep[kv_idx]` (one group's keys: the linked ones, or the
rest). `causal_block_mask` returns the same `BlockMask` as torch's `create_block_mask` over that
rule (partial and full blocks, same ordering), but from per-block minima and maxima of the
indices instead of evaluating the rule at every (query, key) pair under vmap: ~30 tensor ops on
[query blocks, key blocks] tensors instead of ~90 over [queries, keys], on the indices' device,
with no host sync. Block (i, j) of B x B tokens:

    any visible:  first kept key of key block j  <=  max(q_index over query block i)
    full:         every key of j kept, j complete and its last key <= min(q_index over i),
                  and query block i complete (rows past Q_LEN are masked out, as torch pads)
    partial:      any visible and not full
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.nn.attention.flex_attention import BlockMask


def causal_rule(q_index: torch.Tensor, keep: torch.Tensor | None) -> Callable[..., Any]:
    """A FlexAttention mask_mod: key `kv_idx` is visible to query `q_idx` iff kv_idx <=
    q_index[q_idx] (causal by prompt index) and, with `keep` (bool [keys]), keep[kv_idx] (the
    corrected path's groups: the linked keys, or the rest).

    Every mask is built here from two functions defined once, so mask_mods share two code
    objects and dynamo reads q_index and keep as graph inputs: a new request does not recompile
    (dynamo guards on the mask function's code; per-request closures of several functions once
    reached its recompile limit within minutes of serving, and FlexAttention then ran eagerly).
    The plain rule has no `keep` gather: torch 2.13's CPU inductor cannot generate it."""
    if keep is None:

        def causal(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
            return kv_idx <= q_index[q_idx]

        return causal

    def causal_kept(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return (kv_idx <= q_index[q_idx]) & keep[kv_idx]

    return causal_kept


def causal_block_mask(
    q_index: torch.Tensor,
    keep: torch.Tensor | None,
    q_len: int,
    kv_len: int,
    block_size: int,
) -> BlockMask:
    """`BlockMask` of `causal_rule(q_index, keep)` over [q_len, kv_len] in square blocks of
    `block_size` (module docstring), for the forward pass (no transposed indices).

    q_index: int64 [S <= q_len] prompt index per query row; rows S..q_len-1 (a caller's padding
    rows, `FlexShape`) see what the last query sees, and so do the rows up to the last block's
    end, which the kernel never runs (one `cat` for both); keep: None or bool [kv_len]. All work
    stays on q_index's device: no host sync, no host-built tensor."""
    dev, size = q_index.device, block_size
    q_blocks, kv_blocks = -(-q_len // size), -(-kv_len // size)
    pad = q_blocks * size - q_index.shape[0]  # the last query's index, repeated
    padded = torch.cat([q_index, q_index[-1:].expand(pad)]) if pad else q_index
    per_block = padded.view(q_blocks, size)
    highest, lowest = per_block.amax(1), per_block.amin(1)  # [Qb]
    key = torch.arange(kv_blocks * size, device=dev).view(kv_blocks, size)  # [Kb, B]
    if keep is None:
        first = key[:, 0]  # the first key of each block
        whole = key[:, -1] < kv_len  # every key of the block exists
    else:
        kept = torch.zeros(kv_blocks * size, dtype=torch.bool, device=dev)
        kept[:kv_len] = keep
        kept = kept.view(kv_blocks, size)
        first = torch.where(kept, key, kv_blocks * size).amin(1)
        whole = kept.all(1)
    visible = first[None, :] <= highest[:, None]  # [Qb, Kb]
    full = whole[None, :] & (key[:, -1][None, :] <= lowest[:, None])
    if q_len % size:  # rows past q_len are masked out, as torch pads: no full block there
        full[-1] = False
    num, indices = _ordered(visible & ~full)
    full_num, full_indices = _ordered(full)
    return BlockMask.from_kv_blocks(
        num,
        indices,
        full_num,
        full_indices,
        BLOCK_SIZE=size,
        mask_mod=causal_rule(padded, keep),
        seq_lengths=(q_len, kv_len),
        compute_q_blocks=False,
    )


def _ordered(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """bool [Qb, Kb] -> (int32 [1, 1, Qb] blocks per query block, int32 [1, 1, Qb, Kb] their
    key-block indices first, in ascending order), as torch orders them."""
    dense = blocks.to(torch.int32)
    indices = torch.argsort(dense, dim=-1, descending=True, stable=True).to(torch.int32)
    return dense.sum(-1, dtype=torch.int32)[None, None], indices[None, None]
