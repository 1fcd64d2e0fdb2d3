"""`vlcache-<r>`: VLCache (section 4.1, Eq. 8) static or per-layer recompute ratios (linker).

At layer l the first floor(r_l * T) tokens of each image are recomputed, with
r_1 >= r_2 >= ... >= r_L (Eq. 8): a token dropped at layer l skips attention and MLP from there
on and keeps its cached KV ("reuses hidden states of retained tokens ... and skips their
corresponding attention and MLP computations in subsequent layers"). Text (the query) is always
recomputed. A static ratio uses one r for all layers; a list shorter than L repeats its last
value. Per-layer ratios come from the greedy calibration of Eq. 5-9
(`mpic model calibrate-vlcache`, `mpic.linker.calibration.vlcache`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mpic.linker.policies.base import Policy, entry_token_counts, text_depths
from mpic.types import CacheEntry, LinkPlan


class VLCachePolicy(Policy):
    """Per-layer non-increasing ratios of leading image tokens to recompute."""

    def __init__(self, ratios: Sequence[float]) -> None:
        ratios = [float(r) for r in ratios]
        if not ratios or any(not 0 <= r <= 1 for r in ratios):
            raise ValueError(f"vlcache ratios must lie in [0, 1], got {ratios}")
        if any(b > a for a, b in zip(ratios, ratios[1:], strict=False)):
            raise ValueError(f"vlcache ratios must be non-increasing with depth (Eq. 8): {ratios}")
        self.ratios = ratios
        self.name = "vlcache-" + ":".join(f"{r:g}" for r in ratios)

    def layer_ratios(self, num_layers: int) -> list[float]:
        """r_1..r_L (the last given ratio repeats)."""
        if len(self.ratios) > num_layers:
            raise ValueError(f"{len(self.ratios)} vlcache ratios for a {num_layers}-layer model")
        return self.ratios + [self.ratios[-1]] * (num_layers - len(self.ratios))

    def depths(
        self, plan: LinkPlan, entries: Sequence[CacheEntry], num_layers: int
    ) -> torch.Tensor:
        """Item token at offset j of an image of T tokens: #layers l with j < floor(r_l * T)."""
        counts = entry_token_counts(plan, entries)
        depth = torch.zeros(plan.num_tokens, dtype=torch.int64)
        for r in self.layer_ratios(num_layers):
            budget = torch.floor(counts.double() * r + 1e-9).to(torch.int64)
            depth += (plan.source_offset < budget).to(torch.int64)
        item = ~plan.is_text
        return torch.where(item, depth, text_depths(plan, num_layers))
