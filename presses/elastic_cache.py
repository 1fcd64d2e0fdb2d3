"""Elastic Cache (Liu et al., ECCV 2024): importance-driven cache merging at instruction
encoding and fixed-point elimination during generation (reference-runner process).

Instruction encoding (paper section 3.2):

- Eq. 1: causal attention A_{m,n} = exp(<q_m, k_n>) / sum_{m' <= m} exp(<q_m, k_m'>) for m >= n,
  0 otherwise;
- importance I_n^i = (1/K) sum_j sum_m A_{m,n}^{i,j}: the layer-wise sum of attention received,
  averaged over the K heads ("all attention heads in the same layer sharing anchor point
  positions"), here `LayerStats.colsum` averaged over KV heads (query heads already averaged
  per KV head). Under MPIC's selective prefill the sum runs over the queries that were
  recomputed (reused image tokens have none);
- "Given a predefined retention ratio gamma, we select the top N_I = gamma x T tokens in I_n"
  as anchors t_1 < ... < t_{N_I} (gamma = the budget);
- Eq. 2: buckets B_1 = {0..floor((t_1+t_2)/2)}, B_k = {floor((t_{k-1}+t_k)/2)+1 ..
  floor((t_k+t_{k+1})/2)}, B_{N_I} = {.. T}: every token joins its nearest anchor by index, a
  midpoint tie going to the left anchor;
- Eq. 3: KV_k = (1/|B_k|) sum_{t in B_k} kv_t, per head (each head has its own KV_k);
- "we protect the first and the most recent token following [StreamingLLM]": both are anchors.

Output generation (Eq. 5, Algorithm 1): after each new token is added, if the retention ratio
(live entries / tokens seen) exceeds gamma, the entry at the fixed truncation location
N_tl = N_C - 25 is removed ("we fixed the recent distance during the generation period at the
length of 25 caches"), keeping the instruction's merged cache and the 25 most recent entries.
"""

from __future__ import annotations

import torch

from mpic.presses.base import PressContext, ScorerPress, gather_tokens, merge_into
from mpic.presses.cache import CompressedKV
from mpic.presses.observe import LayerStats


def nearest_anchor_buckets(anchors: torch.Tensor, n: int) -> torch.Tensor:
    """Eq. 2: bucket (0..C-1) of each of n tokens given ascending anchor indices [C] -> [N]."""
    t = torch.arange(n)
    right = torch.searchsorted(anchors, t).clamp(max=anchors.numel() - 1)  # first anchor >= t
    left = (right - 1).clamp(min=0)
    mid = torch.div(anchors[left] + anchors[right], 2, rounding_mode="floor")
    use_left = (anchors[right] > t) & (t <= mid) & (right > 0)
    return torch.where(use_left, left, right)


class ElasticCachePress(ScorerPress):
    """recent_window: generation-time distance of the truncation point (paper: 25);
    eliminate: run the generation-time elimination (Eq. 5); merge: Eq. 3 bucket averaging
    (False keeps only the anchors: the ablation in docs/presses.md)."""

    name = "elastic"

    def __init__(self, recent_window: int = 25, eliminate: bool = True, merge: bool = True) -> None:
        self.recent_window, self.eliminate, self.merge = recent_window, eliminate, merge
        self._gamma = 1.0

    def score(
        self,
        layer: int,
        keys: torch.Tensor,
        values: torch.Tensor,
        stats: LayerStats,
        ctx: PressContext,
    ) -> torch.Tensor:
        """[N]: I_n of the layer, averaged over heads (anchors shared by the layer's heads)."""
        return stats.colsum.float().mean(0)

    def forced(self, ctx: PressContext, keep: int) -> torch.Tensor | None:
        f = torch.zeros(ctx.num_tokens, dtype=torch.bool)
        f[ctx.num_tokens - 1] = True
        if keep > 1:
            f[0] = True
        return f

    def compress(self, keys, values, stats, ctx, budget, extra) -> CompressedKV:  # noqa: ANN001
        self._gamma = budget
        return super().compress(keys, values, stats, ctx, budget, extra)

    def compress_layer(
        self,
        layer: int,
        keys: torch.Tensor,
        values: torch.Tensor,
        stats: LayerStats,
        keep: int,
        ctx: PressContext,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        anchors = self.select(layer, keys, values, stats, keep, ctx)  # [C] ascending
        bucket = nearest_anchor_buckets(anchors.cpu(), ctx.num_tokens)
        if keep == ctx.num_tokens or not self.merge:
            return gather_tokens(keys, anchors), gather_tokens(values, anchors)
        return merge_into(keys, values, bucket, anchors)

    def after_decode_step(self, kv: CompressedKV, seen_tokens: int) -> None:
        """Fixed-point elimination: while live / seen > gamma, drop entry N_C - recent_window."""
        if not self.eliminate or self._gamma >= 1.0:
            return
        live = max(kv.lengths)
        if live > self._gamma * seen_tokens:
            slot = live - 1 - self.recent_window
            if slot >= 1:  # the first token stays protected
                kv.evict(slot)
