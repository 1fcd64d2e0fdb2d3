"""`full-reuse`: two steps, text KV first, then every KV reused (MPIC paper section 2.2, like
Prompt Cache): only the last prompt token is recomputed in the second step (linker)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mpic.linker.policies.base import Policy
from mpic.types import CacheEntry, LinkPlan


class FullReusePolicy(Policy):
    """Text in a first pass of its own (no items in view), then reuse everything."""

    name = "full-reuse"
    two_step = True

    def depths(
        self, plan: LinkPlan, entries: Sequence[CacheEntry], num_layers: int
    ) -> torch.Tensor:
        """0 everywhere (the base class recomputes the last token)."""
        return torch.zeros(plan.num_tokens, dtype=torch.int64)
