"""`mpic-k`: all text plus the first k tokens of each item (MPIC paper section 4.2, Insights 2-3:
the first image tokens draw the most attention and deviate most when moved) (linker)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mpic.linker.policies.base import Policy, text_depths
from mpic.types import CacheEntry, LinkPlan


class MPICPolicy(Policy):
    """Text and the first `k` tokens of every item occurrence recomputed at every layer."""

    def __init__(self, k: int) -> None:
        if k < 0:
            raise ValueError(f"mpic-k needs k >= 0, got {k}")
        self.k = k
        self.name = f"mpic-{k}"

    def depths(
        self, plan: LinkPlan, entries: Sequence[CacheEntry], num_layers: int
    ) -> torch.Tensor:
        """L where text or item offset < k, else 0."""
        head = (~plan.is_text) & (plan.source_offset < self.k)
        return torch.where(head, num_layers, text_depths(plan, num_layers))
