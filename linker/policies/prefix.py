"""`prefix`: reuse only an exact shared prefix, as vLLM/SGLang prefix caching (MPIC paper
section 2.2, Appendix A) (linker).

An entry's KV was computed after its canonical context (`entry.extra["context_token_ids"]`,
system prompt + start of a user turn). The prompt hits the cache only as far as it repeats that
context token for token and then the same image: the longest such match over the linked
entries is the reusable prefix. Everything from the first differing token on is recomputed. In
the prefix the item tokens are reused (same context, same positions: exact); its text tokens
(the system prompt) are recomputed here because entries store only item KV: a few tokens, and
the serving engine's own prefix cache covers them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mpic.linker.policies.base import Policy, text_depths
from mpic.types import CacheEntry, LinkPlan


def shared_prefix_length(plan: LinkPlan, entries: Sequence[CacheEntry]) -> int:
    """Length of the longest prompt prefix equal to some entry's canonical context + item."""
    best = 0
    for e_idx, entry in enumerate(entries):
        context = torch.tensor(entry.extra.get("context_token_ids", []), dtype=torch.int64)
        c, t = context.numel(), entry.num_tokens
        if c + t > plan.num_tokens or not bool(plan.is_text[:c].all()):
            continue
        if not torch.equal(plan.token_ids[:c], context):
            continue
        same_item = (plan.source_entry[c : c + t] == e_idx) & (
            plan.source_offset[c : c + t] == torch.arange(t)
        )
        matched = int(torch.cumprod(same_item.to(torch.int64), 0).sum())
        best = max(best, c + matched)
    return best


class PrefixPolicy(Policy):
    """Reuse items inside the exact shared prefix; recompute everything after it."""

    name = "prefix"

    def depths(
        self, plan: LinkPlan, entries: Sequence[CacheEntry], num_layers: int
    ) -> torch.Tensor:
        """0 for item tokens inside the shared prefix, L elsewhere."""
        depth = torch.full((plan.num_tokens,), num_layers, dtype=torch.int64)
        m = shared_prefix_length(plan, entries)
        depth[:m] = text_depths(plan, num_layers)[:m]
        return depth
