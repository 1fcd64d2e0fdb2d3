"""`boundary-k`: mpic-k plus the line breaks of text documents (linker; runs wherever a plan is
built).

Measured on the trained SmolLM2-135M with cached standard-library docstrings (docs/fidelity.md):
which document tokens does CacheBlend's KV-deviation check (layer 1, top 30%) pick? A third lie
in the first 16 tokens of each document (MPIC's Insight 3 holds for text too) and most of the
rest are delimiters: 20 of the 39 line-break tokens, 13 of 17 full stops, 12 of 15 commas, while
ordinary words are rarely chosen. Delimiters gather attention in trained LMs, so their stale KV
costs most. This policy makes that choice statically, in one pass and without a check layer:
all text, the first k tokens of every item occurrence, and every token of a document that holds
a line break (its offsets are recorded when the document is cached, `extra["line_breaks"]`,
because the policy sees token ids but not the tokenizer). Images have no line breaks, so on an
image `boundary-k` is `mpic-k`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mpic.linker.policies.base import Policy, text_depths
from mpic.types import CacheEntry, LinkPlan


def line_break_mask(plan: LinkPlan, entries: Sequence[CacheEntry]) -> torch.Tensor:
    """bool [N]: item tokens whose entry lists their offset in `extra["line_breaks"]`."""
    out = torch.zeros(plan.num_tokens, dtype=torch.bool)
    for e_idx, entry in enumerate(entries):
        breaks = entry.extra.get("line_breaks")
        if not breaks:
            continue
        marked = torch.zeros(entry.num_tokens, dtype=torch.bool)
        marked[torch.as_tensor(breaks, dtype=torch.int64)] = True
        here = plan.source_entry == e_idx
        out[here] = marked[plan.source_offset[here]]
    return out


class BoundaryPolicy(Policy):
    """Text, the first `k` tokens of every item and the line-break tokens of documents, at every
    layer."""

    def __init__(self, k: int) -> None:
        if k < 0:
            raise ValueError(f"boundary-k needs k >= 0, got {k}")
        self.k = k
        self.name = f"boundary-{k}"

    def depths(
        self, plan: LinkPlan, entries: Sequence[CacheEntry], num_layers: int
    ) -> torch.Tensor:
        """L where text, item offset < k, or a document line break; else 0."""
        chosen = (~plan.is_text) & ((plan.source_offset < self.k) | line_break_mask(plan, entries))
        return torch.where(chosen, num_layers, text_depths(plan, num_layers))
