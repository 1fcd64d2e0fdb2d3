"""Attention of selected queries over linked keys with an exact causal mask by prompt index
(torch reference; runs in the reference runner and anywhere a dense linked KV is used).

This is the core of MPIC's selective attention (paper section 4.1, Fig. 7): only the S recomputed
tokens issue queries, but they attend over all N linked keys (cached, rotated item KV plus fresh
KV of recomputed tokens). A query at prompt index i sees keys at indices <= i. Grouped-query
attention (H query heads sharing H_kv KV heads) is handled by SDPA's `enable_gqa`.

Cost: S x N scores per head instead of N x N; the boolean mask is S x n where n is one more than
the largest query index (keys after it can never be seen), so no N x N mask is built when S << N.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def selected_attention(
    q: torch.Tensor,
    q_index: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """Causal attention of selected queries over linked keys.

    q: [S, H, D] queries of the tokens at prompt indices `q_index` (int64 [S], ascending).
    keys, values: [N, H_kv, D] linked KV indexed by prompt index (H % H_kv == 0).
    scale: softmax scale, default D ** -0.5. Returns [S, H, D] in q's dtype.
    """
    seen = int(q_index[-1]) + 1
    k = keys[:seen].transpose(0, 1)[None]  # [1, H_kv, n, D]
    v = values[:seen].transpose(0, 1)[None]
    qh = q.transpose(0, 1)[None]  # [1, H, S, D]
    gqa = q.shape[1] != keys.shape[1]
    s = q.shape[0]
    if s == seen:  # the queries are exactly indices 0..n-1: plain causal prefill
        out = F.scaled_dot_product_attention(qh, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
    else:
        key_index = torch.arange(seen, device=q.device)
        mask = key_index[None, :] <= q_index[:, None]  # [S, n]
        out = F.scaled_dot_product_attention(qh, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
    return out[0].transpose(0, 1)
