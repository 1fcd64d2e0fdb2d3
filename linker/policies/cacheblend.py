"""`cacheblend-r`: CacheBlend (Yao et al., EuroSys'25) as the MPIC paper runs it (section 5.2):
two steps; text KV first, then one blended pass that recomputes every token up to the check
layer, keeps ALL the new text and the r% of the ITEM tokens whose fresh keys deviate most from
the linked (reused) keys, and recomputes only those in the remaining layers (linker).

As published: CacheBlend selects among the reused (cached) tokens; the new text has no cache and
is always recomputed. (An earlier version took r% of all prompt tokens, text included, so at
4 documents its budget was smaller than the text alone.) LMCache's blender defaults: check
layer 1 (`check_layers=[1]`), deviation = sum of squared differences of the keys over heads and
head dims.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from mpic.linker.kv.linked import LinkedKV
from mpic.linker.policies.base import Policy
from mpic.types import CacheEntry, LinkPlan


class KVDeviationHook:
    """At `check_layer`, keep every `always` token (the text and the last token) and the `count`
    other tokens with the largest key deviation."""

    def __init__(
        self, check_layer: int, count: int, last_index: int, always: torch.Tensor | None = None
    ) -> None:
        self.check_layer = check_layer
        self.count = count
        self.last_index = last_index
        self.always = always
        """bool [N] by prompt index, or None (nothing but the last token)."""

    def acts_at(self, layer: int) -> bool:
        """Only at the check layer."""
        return layer == self.check_layer

    def select(
        self, layer: int, index: torch.Tensor, k: torch.Tensor, linked_kv: LinkedKV
    ) -> torch.Tensor | None:
        """bool [S]: the tokens to keep recomputing (None before/after the check layer)."""
        if not self.acts_at(layer):
            return None
        old = linked_kv.read_keys(layer, index).to(k.device, torch.float32)
        deviation = (k.float() - old).pow(2).sum(dim=(-2, -1)).cpu()  # [S]
        host = index.cpu()
        always = host == self.last_index
        if self.always is not None:
            always |= self.always[host]
        keep = always.clone()
        candidates = torch.nonzero(~always).flatten()
        if candidates.numel():
            top = torch.topk(deviation[candidates], min(self.count, candidates.numel())).indices
            keep[candidates[top]] = True
        return keep


class CacheBlendPolicy(Policy):
    """Recompute r% of the prompt's tokens, chosen by KV deviation at an early layer."""

    two_step = True

    def __init__(self, ratio_percent: float, check_layer: int = 1) -> None:
        if not 0 <= ratio_percent <= 100:
            raise ValueError(f"cacheblend-r needs 0 <= r <= 100, got {ratio_percent}")
        self.ratio_percent = ratio_percent
        self.check_layer = check_layer
        self.name = f"cacheblend-{ratio_percent:g}"

    def depths(
        self, plan: LinkPlan, entries: Sequence[CacheEntry], num_layers: int
    ) -> torch.Tensor:
        """L everywhere: every token runs until the check layer decides (see `layer_hook`)."""
        return torch.full((plan.num_tokens,), num_layers, dtype=torch.int64)

    def selected_count(self, num_item_tokens: int) -> int:
        """ceil(r% of the item tokens): how many item tokens survive the check layer."""
        return math.ceil(self.ratio_percent * num_item_tokens / 100)

    def layer_hook(self, plan: LinkPlan, num_layers: int) -> KVDeviationHook:
        """The KV-deviation check at `min(check_layer, L - 1)`: all text, r% of the items."""
        check = min(self.check_layer, num_layers - 1)
        items = int((~plan.is_text).sum())
        return KVDeviationHook(
            check, self.selected_count(items), plan.num_tokens - 1, plan.is_text.clone()
        )
