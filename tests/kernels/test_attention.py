"""Selected-query attention over linked keys equals a naive masked softmax (GQA, any subset)."""

import pytest
import torch

from mpic.kernels.attention import selected_attention


def naive(q, q_index, k, v):
    groups = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    out = torch.empty_like(q)
    for row, i in enumerate(q_index.tolist()):
        scores = torch.einsum("hd,khd->hk", q[row], kk[: i + 1]) / q.shape[-1] ** 0.5
        out[row] = torch.einsum("hk,khd->hd", scores.softmax(-1), vv[: i + 1])
    return out


@pytest.mark.parametrize("subset", ["all", "sparse", "tail"])
def test_matches_naive(subset):
    g = torch.Generator().manual_seed(0)
    n, h, hkv, d = 37, 8, 2, 16
    k, v = torch.randn(n, hkv, d, generator=g), torch.randn(n, hkv, d, generator=g)
    index = {
        "all": torch.arange(n),
        "sparse": torch.tensor([0, 3, 4, 9, 20, 21, 30]),
        "tail": torch.arange(25, 31),
    }[subset]
    q = torch.randn(index.numel(), h, d, generator=g)
    torch.testing.assert_close(
        selected_attention(q, index, k, v), naive(q, index, k, v), rtol=1e-5, atol=1e-5
    )


def test_keys_after_the_query_are_never_seen():
    k, v = torch.randn(10, 1, 8), torch.randn(10, 1, 8)
    q, index = torch.randn(2, 1, 8), torch.tensor([2, 5])
    before = selected_attention(q, index, k, v)
    k[6:], v[6:] = 1e4, 1e4
    torch.testing.assert_close(selected_attention(q, index, k, v), before)
