"""`full`: no cache, every token recomputed at every layer: the exact reference (linker)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mpic.linker.policies.base import Policy
from mpic.types import CacheEntry, LinkPlan


class FullPolicy(Policy):
    """Recompute everything; the selective pass then equals a plain prefill."""

    name = "full"

    def depths(
        self, plan: LinkPlan, entries: Sequence[CacheEntry], num_layers: int
    ) -> torch.Tensor:
        """L everywhere."""
        return torch.full((plan.num_tokens,), num_layers, dtype=torch.int64)
