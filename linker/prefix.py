"""The template/system prefix linked exactly from a cache (linker; reference runner).

Every entry is computed after its canonical context (`CacheEntry.extra["context_token_ids"]`:
the chat template's system prompt and the start of a user turn). A prompt rendered with the same
template starts with the same tokens, and the KV of a prompt's first P tokens depends on those
P tokens only (causal attention, positions 0..P-1): so the longest common prefix of the prompt
and an entry's context has exactly the KV of the context's own prefill. `PrefixCache` keeps that
KV once per context (one plain prefill of the context, ~24 tokens on SmolLM2's template) and
`CachedPrefix` hands its first P tokens to `link_and_prefill`, which writes them into the linked
KV and leaves them out of the selective pass (depth 0, counted as cached, never corrected: they
are text, not linked item keys). Only text before the first item qualifies.

The vLLM worker does not link it (its plans keep the prefix recomputed); vLLM's own prefix
caching would hold those blocks, block-aligned (docs/fidelity.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mpic.linker.contracts import LayerAdapter
from mpic.linker.dense_kv import DenseLinkedKV
from mpic.linker.positions import text_positions
from mpic.linker.selective_prefill import run_layers
from mpic.types import CacheEntry, LinkPlan


@dataclass(frozen=True)
class CachedPrefix:
    """The first `length` prompt tokens' exact KV."""

    length: int
    """P: prompt tokens 0..P-1 are linked from here."""
    keys: torch.Tensor
    """[L, P, H_kv, D] post-RoPE at positions 0..P-1."""
    values: torch.Tensor
    """[L, P, H_kv, D]."""


def common_prefix(plan: LinkPlan, context: Sequence[int]) -> int:
    """Leading prompt tokens equal to `context`'s and before the first item token (at most
    N - 1: the last prompt token is always recomputed)."""
    items = torch.nonzero(~plan.is_text).flatten()
    limit = min(len(context), plan.num_tokens - 1)
    if items.numel():
        limit = min(limit, int(items[0]))
    ids = plan.token_ids[:limit].tolist()
    length = 0
    for a, b in zip(ids, context, strict=False):
        if a != b:
            break
        length += 1
    return length


class PrefixCache:
    """Context KV by context token ids (one plain prefill per distinct context)."""

    def __init__(self, adapter: LayerAdapter, family: str) -> None:
        self.adapter = adapter
        self.family = family
        self._kv: dict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor]] = {}

    def _context_kv(self, context: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        if context not in self._kv:
            a, c = self.adapter, len(context)
            kv = DenseLinkedKV(a.num_layers, c, a.num_kv_heads, a.head_dim, a.dtype, a.device)
            ids = torch.tensor(context, dtype=torch.int64)
            with torch.inference_mode():
                run_layers(
                    a,
                    kv,
                    a.embed_tokens(ids),
                    torch.arange(c),
                    text_positions(self.family, 0, c),
                    torch.full((c,), a.num_layers, dtype=torch.int64),
                )
            self._kv[context] = (kv.keys, kv.values)
        return self._kv[context]

    def lookup(self, plan: LinkPlan, entries: Sequence[CacheEntry]) -> CachedPrefix | None:
        """The plan's longest prefix shared with one of its entries' contexts, or None (no
        entry, or no token in common)."""
        best: tuple[int, tuple[int, ...]] = (0, ())
        for entry in entries:
            context = tuple(entry.extra.get("context_token_ids") or ())
            length = common_prefix(plan, context)
            if length > best[0]:
                best = (length, context)
        length, context = best
        if length == 0:
            return None
        keys, values = self._context_kv(context)
        return CachedPrefix(length, keys[:, :length], values[:, :length])
