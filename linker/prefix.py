"""The template/system prefix linked exactly from a cache (linker; both engines).

Every entry is computed after its canonical context (`CacheEntry.extra["context_token_ids"]`:
the chat template's system prompt and the start of a user turn). A prompt rendered with the same
template starts with the same tokens, and the KV of a prompt's first P tokens depends on those
P tokens only (causal attention, positions 0..P-1): so the longest common prefix of the prompt
and an entry's context has exactly the KV of the context's own prefill. `PrefixCache` keeps that
KV once per context (one plain prefill of the context, ~24 tokens on SmolLM2's template) and
`CachedPrefix` hands its first P tokens to `link_and_prefill`, which writes them into the linked
KV and leaves them out of the selective pass (depth 0, counted as cached, never corrected: they
are text, not linked item keys). Only text before the first item qualifies.

Both engines link it, on by default (`ReferenceRunner(link_prefix=True)`; the vLLM worker,
`VllmEngineConfig.link_prefix`): the reference runner at planning time, the vLLM worker in its own
process over its own layer adapter (`mpic.engine.vllm.connector.worker`), from the entries it
has just read, with its own `PrefixCache` (a context it has never seen is prefilled there on first
use). Both decide P with `prefix_length` from the same plan and entries, so they select the same
tokens under the same budget. vLLM's own prefix caching cannot hold those blocks: linked requests
are cache-salted per plan, and it would be block-aligned (16 of 24 tokens; docs/fidelity.md).
`links_prefix` names the policies that take it (all but `full` and `prefix`, which recompute or
reuse the prompt's own prefix); two-step and in-pass-hook policies still recompute it
(`mpic.linker.pipeline`).
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from mpic.linker.contracts import LayerAdapter
from mpic.linker.kv.dense import DenseLinkedKV
from mpic.linker.kv.linked import LinkedKV
from mpic.linker.selective_prefill import run_layers
from mpic.types import MROPE_FAMILIES, CacheEntry, LinkPlan

if TYPE_CHECKING:
    from mpic.linker.policies.base import Policy


@dataclass(frozen=True)
class CachedPrefix:
    """The first `length` prompt tokens' exact KV."""

    length: int
    """P: prompt tokens 0..P-1 are linked from here."""
    keys: torch.Tensor
    """[L, P, H_kv, D] post-RoPE at positions 0..P-1."""
    values: torch.Tensor
    """[L, P, H_kv, D]."""

    def write(self, kv: LinkedKV) -> None:
        """Write the P tokens' exact KV into slots 0..P-1 of a linked KV (dense or paged)."""
        kv.write_layers(torch.arange(self.length), self.keys, self.values)

    def exclude(self, plan: LinkPlan) -> LinkPlan:
        """`plan` with tokens 0..P-1 at depth 0 (linked from here: not recomputed)."""
        return exclude_prefix(plan, self.length)


def exclude_prefix(plan: LinkPlan, length: int) -> LinkPlan:
    """`plan` with its first `length` tokens at depth 0 (a cached prefix: not recomputed)."""
    if not bool((plan.recompute_depth[:length] > 0).any()):
        return plan
    depth = plan.recompute_depth.clone()
    depth[:length] = 0
    return dataclasses.replace(plan, recompute_depth=depth)


def common_prefix(plan: LinkPlan, context: Sequence[int]) -> int:
    """Leading prompt tokens equal to `context`'s and before the first item token (at most
    N - 1: the last prompt token is always recomputed)."""
    return _shared(_leading_text(plan), context)


def _leading_text(plan: LinkPlan) -> list[int]:
    """The prompt's token ids before its first item token, at most N - 1 of them."""
    first_item = torch.nonzero(~plan.is_text)[:1].flatten().tolist()
    return plan.token_ids[: min([plan.num_tokens - 1, *first_item])].tolist()


def _shared(lead: Sequence[int], context: Sequence[int]) -> int:
    """Length of the longest common prefix of two token id sequences."""
    length = 0
    for a, b in zip(lead, context, strict=False):
        if a != b:
            break
        length += 1
    return length


def links_prefix(policy_name: str) -> bool:
    """True for the policies that link the prefix (all but `full`, which recomputes every
    token, and `prefix`, which reuses the prompt's own prefix)."""
    return policy_name not in ("full", "prefix")


def takes_prefix(policy: Policy, plan: LinkPlan, num_layers: int) -> bool:
    """True when `link_and_prefill` links a cached prefix under `policy`: `links_prefix`, and
    neither a two-step policy nor an in-pass hook (CacheBlend), which recompute it."""
    return (
        links_prefix(policy.name)
        and not policy.two_step
        and policy.layer_hook(plan, num_layers) is None
    )


def prefix_length(plan: LinkPlan, entries: Sequence[CacheEntry]) -> int:
    """P: the plan's longest prefix shared with one of its entries' canonical contexts (0: no
    entry, no context, or no token in common). Both engines decide P with this."""
    return _best_context(plan, entries)[0]


def _best_context(plan: LinkPlan, entries: Sequence[CacheEntry]) -> tuple[int, tuple[int, ...]]:
    lead = _leading_text(plan)  # once per plan: a few host ops, not a few per entry
    contexts = dict.fromkeys(tuple(e.extra.get("context_token_ids") or ()) for e in entries)
    best: tuple[int, tuple[int, ...]] = (0, ())
    for context in contexts:
        length = _shared(lead, context)
        if length > best[0]:
            best = (length, context)
    return best


class PrefixCache:
    """Context KV by context token ids (one plain prefill per distinct context; the
    `max_contexts` most recently used are kept). family: the model family (M-RoPE families get
    [3, C] text positions); None: read from the adapter's RoPE (`mrope_section`)."""

    def __init__(
        self, adapter: LayerAdapter, family: str | None = None, max_contexts: int = 64
    ) -> None:
        self.adapter = adapter
        if family is None:
            self.mrope = getattr(adapter.rope, "mrope_section", None) is not None
        else:
            self.mrope = family in MROPE_FAMILIES
        self.max_contexts = max_contexts
        self._kv: OrderedDict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor]] = OrderedDict()
        self.prefills = 0
        """Contexts prefilled so far (a context seen before is not prefilled again)."""

    def _context_kv(self, context: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        if context in self._kv:
            self._kv.move_to_end(context)
            return self._kv[context]
        a, c = self.adapter, len(context)
        kv = DenseLinkedKV(a.num_layers, c, a.num_kv_heads, a.head_dim, a.dtype, a.device)
        ids = torch.tensor(context, dtype=torch.int64)
        positions = torch.arange(c, dtype=torch.int64)
        if self.mrope:
            positions = positions.expand(3, -1).clone()
        with torch.inference_mode():
            run_layers(
                a,
                kv,
                a.embed_tokens(ids),
                torch.arange(c),
                positions,
                torch.full((c,), a.num_layers, dtype=torch.int64),
                outputs=torch.zeros(c, dtype=torch.bool),  # their KV alone is read
            )
        self.prefills += 1
        self._kv[context] = (kv.keys, kv.values)
        while len(self._kv) > self.max_contexts:
            self._kv.popitem(last=False)
        return self._kv[context]

    def lookup(self, plan: LinkPlan, entries: Sequence[CacheEntry]) -> CachedPrefix | None:
        """The plan's longest prefix shared with one of its entries' contexts (`prefix_length`),
        or None (no entry, or no token in common)."""
        length, context = _best_context(plan, entries)
        if length == 0:
            return None
        keys, values = self._context_kv(context)
        return CachedPrefix(length, keys[:, :length], values[:, :length])
