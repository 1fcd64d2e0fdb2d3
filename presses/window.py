"""Recency-window baseline (StreamingLLM-like: attention sinks + the most recent tokens;
reference-runner process).

StreamingLLM (Xiao et al.) keeps the first few tokens ("attention sinks", 4 by default) and a
window of the most recent ones. At budget C per layer this press keeps tokens 0..sink-1 and the
last C - sink prompt tokens, in every layer and head: the same set everywhere, so it is also its
own uniform-across-layers variant. It uses no statistics.
"""

from __future__ import annotations

import torch

from mpic.presses.base import PressContext, ScorerPress
from mpic.presses.observe import LayerStats


class WindowPress(ScorerPress):
    """Sinks + recent window. sink: number of leading tokens always kept (StreamingLLM: 4)."""

    name = "window"

    def __init__(self, sink: int = 4) -> None:
        self.sink = sink

    def score(
        self,
        layer: int,
        keys: torch.Tensor,
        values: torch.Tensor,
        stats: LayerStats,
        ctx: PressContext,
    ) -> torch.Tensor:
        """[N]: later tokens score higher (recency)."""
        return torch.arange(ctx.num_tokens, dtype=torch.float32)

    def forced(self, ctx: PressContext, keep: int) -> torch.Tensor | None:
        f = torch.zeros(ctx.num_tokens, dtype=torch.bool)
        f[: min(self.sink, keep)] = True
        return f
