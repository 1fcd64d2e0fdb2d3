"""`causal_block_mask` builds the same block mask as torch's `create_block_mask` over the same
rule, from the indices' per-block bounds."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from mpic.kernels.block_masks import causal_block_mask, causal_rule

CASES = [
    # (query rows, keys, block size, ascending indices)
    (256, 256, 128, True),
    (300, 700, 128, True),
    (129, 1000, 128, False),
    (40, 90, 16, True),
    (77, 333, 32, False),
    (1000, 1000, 64, True),
]


def _indices(rows: int, keys: int, ascending: bool, gen: torch.Generator) -> torch.Tensor:
    """Prompt indices of `rows` queries among `keys` prompt tokens (the last one included)."""
    chosen = torch.randperm(keys, generator=gen)[:rows]
    chosen[0] = keys - 1
    return chosen.sort().values if ascending else chosen


def _as_dense(num: torch.Tensor, indices: torch.Tensor, kv_blocks: int) -> torch.Tensor:
    """bool [Qb, Kb] from (num [1, 1, Qb], indices [1, 1, Qb, Kb]): the blocks listed."""
    dense = torch.zeros(num.shape[-1], kv_blocks, dtype=torch.bool)
    for i, n in enumerate(num[0, 0].tolist()):
        dense[i, indices[0, 0, i, :n].long()] = True
    return dense


@pytest.mark.parametrize(("rows", "keys", "size", "ascending"), CASES)
@pytest.mark.parametrize("with_keep", [False, True])
def test_equals_torchs_block_mask(
    rows: int, keys: int, size: int, ascending: bool, with_keep: bool
) -> None:
    gen = torch.Generator().manual_seed(rows * 7 + keys)
    q_index = _indices(rows, keys, ascending, gen)
    keep = (torch.rand(keys, generator=gen) < 0.4) if with_keep else None
    if keep is not None:
        keep[: size + 3] = True  # a wholly kept first block: full blocks exist too
    ours = causal_block_mask(q_index, keep, rows, keys, size)
    theirs = create_block_mask(
        causal_rule(q_index, keep), None, None, rows, keys, device="cpu", BLOCK_SIZE=size
    )
    kv_blocks = -(-keys // size)
    assert torch.equal(ours.kv_num_blocks, theirs.kv_num_blocks)
    assert torch.equal(ours.full_kv_num_blocks, theirs.full_kv_num_blocks)
    # the listed blocks, in the same order (entries past the count are never read)
    for mine, ref in (
        (ours.kv_indices, theirs.kv_indices),
        (ours.full_kv_indices, theirs.full_kv_indices),
    ):
        assert mine.dtype == ref.dtype == torch.int32
        assert mine.shape == ref.shape
    assert torch.equal(
        _as_dense(ours.kv_num_blocks, ours.kv_indices, kv_blocks),
        _as_dense(theirs.kv_num_blocks, theirs.kv_indices, kv_blocks),
    )
    assert torch.equal(ours.kv_indices, theirs.kv_indices)
    assert torch.equal(ours.full_kv_indices, theirs.full_kv_indices)
    assert ours.seq_lengths == theirs.seq_lengths == (rows, keys)
    if ascending:  # shuffled indices put a small index in every block: no full block
        assert int(ours.full_kv_num_blocks.sum()) > 0


def test_attention_under_it_equals_the_dense_rule() -> None:
    """FlexAttention with the built mask equals SDPA with the dense mask of the same rule."""
    gen = torch.Generator().manual_seed(0)
    rows, keys, heads, dim = 200, 450, 2, 16
    q_index = _indices(rows, keys, True, gen)
    q = torch.randn(1, heads, rows, dim, generator=gen)
    k = torch.randn(1, heads, keys, dim, generator=gen)
    v = torch.randn(1, heads, keys, dim, generator=gen)
    mask = causal_block_mask(q_index, None, rows, keys, 64)
    out = flex_attention(q, k, v, block_mask=mask)
    dense = torch.arange(keys)[None, :] <= q_index[:, None]
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=dense)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("rows", "q_len"), [(100, 256), (130, 300), (256, 256)])
def test_padding_rows_repeat_the_last_query(rows: int, q_len: int) -> None:
    """Fewer indices than q_len (a caller's padding rows, `FlexShape`): the same block mask as
    torch's over the indices padded with the last one."""
    gen = torch.Generator().manual_seed(rows)
    q_index = _indices(rows, 700, True, gen)
    padded = torch.cat([q_index, q_index[-1:].expand(q_len - rows)])
    ours = causal_block_mask(q_index, None, q_len, 700, 128)
    theirs = create_block_mask(
        causal_rule(padded, None), None, None, q_len, 700, device="cpu", BLOCK_SIZE=128
    )
    for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices"):
        assert torch.equal(getattr(ours, name), getattr(theirs, name)), name
