"""SnapKV baseline: observation-window attention scores (reference-runner process).

SnapKV (Li et al., 2024) scores each prompt key by the attention it receives from the queries of
the last W prompt tokens (the observation window), smooths the scores with a 1-D pooling over
neighbouring tokens, keeps the top ones per KV head and always keeps the window itself. Defaults
follow kvpress's SnapKVPress: window W = 64, average pooling with kernel 5. Scores are the
window queries' attention (`LayerStats.window_colsum`, query heads averaged per KV head); under
MPIC's selective prefill the window is the recomputed tokens among the last W (the prompt's
closing text always is).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mpic.presses.base import PressContext, ScorerPress
from mpic.presses.observe import LayerStats


class SnapKVPress(ScorerPress):
    """window: observation window W; kernel: pooling kernel size (odd)."""

    name = "snapkv"

    def __init__(self, window: int = 64, kernel: int = 5) -> None:
        self.window, self.kernel = window, kernel

    def score(
        self,
        layer: int,
        keys: torch.Tensor,
        values: torch.Tensor,
        stats: LayerStats,
        ctx: PressContext,
    ) -> torch.Tensor:
        """[H_kv, N] pooled window attention."""
        s = stats.window_colsum.float()
        return F.avg_pool1d(s[:, None], self.kernel, stride=1, padding=self.kernel // 2)[:, 0]

    def forced(self, ctx: PressContext, keep: int) -> torch.Tensor | None:
        f = torch.zeros(ctx.num_tokens, dtype=torch.bool)
        f[ctx.num_tokens - min(self.window, keep) :] = True
        return f
