"""Attention of selected queries over linked keys with an exact causal mask by prompt index
(torch reference; runs in the reference runner and anywhere a dense linked KV is used).

This is the core of MPIC's selective attention (paper section 4.1, Fig. 7): only the S recomputed
tokens issue queries, but they attend over all N linked keys (cached, rotated item KV plus fresh
KV of recomputed tokens). A query at prompt index i sees keys at indices <= i. Grouped-query
attention (H query heads sharing H_kv KV heads) is handled by SDPA's `enable_gqa`.

Cost: each contiguous run of queries [a, b) scores only keys [0, b), so the work is at most
S x N per head (not N x N), and no N x N mask is built when S << N.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def query_runs(q_index: torch.Tensor) -> list[tuple[int, int]]:
    """Split ascending prompt indices into maximal contiguous runs: [(row_start, row_end)]."""
    breaks = torch.nonzero(q_index[1:] != q_index[:-1] + 1).flatten() + 1
    edges = [0, *breaks.tolist(), int(q_index.shape[0])]
    return list(zip(edges[:-1], edges[1:], strict=False))


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

    The recomputed tokens form a few contiguous runs (text, the first k tokens of an item;
    docs/design.md "Exact masks"): a run at indices [a, b) sees keys [0, a) fully and itself
    causally, so each run is one SDPA call over keys [0, b) with a mask of its own size only.
    """
    gqa = q.shape[1] != keys.shape[1]
    outs = []
    for r0, r1 in query_runs(q_index):
        a, b = int(q_index[r0]), int(q_index[r1 - 1]) + 1
        k = keys[:b].transpose(0, 1)[None]  # [1, H_kv, b, D]
        v = values[:b].transpose(0, 1)[None]
        qh = q[r0:r1].transpose(0, 1)[None]  # [1, H, run, D]
        mask, causal = None, a == 0 and r1 - r0 > 1  # [0, b): a plain causal prefill
        if r1 - r0 > 1 and not causal:  # key j visible to the query at a + i iff j <= a + i
            mask = (
                torch.arange(b, device=q.device)[None, :]
                <= torch.arange(a, b, device=q.device)[:, None]
            )
        out = F.scaled_dot_product_attention(
            qh, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=gqa
        )
        outs.append(out[0].transpose(0, 1))
    return torch.cat(outs) if len(outs) > 1 else outs[0]
