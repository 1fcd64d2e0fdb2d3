"""The token-selection policy interface (linker; runs wherever a plan is built).

One policy per file on this small base (kvpress's layout). A policy turns a fresh
`LinkPlan` into one with `recompute_depth` set: the number of leading layers each token is
recomputed at (0 = reused everywhere, L = recomputed everywhere). Two optional extras:
`two_step` (text KV is computed in a separate first pass, as full reuse and CacheBlend do in
the MPIC paper's section 5.2) and `layer_hook` (a selection made inside the pass from runtime
values, CacheBlend's KV deviation). The last prompt token is always recomputed: its hidden state
gives the first output token.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Sequence

import torch

from mpic.linker.contracts import LayerAdapter
from mpic.linker.correction import LinkCorrection
from mpic.linker.kv.linked import LinkedKV
from mpic.linker.link import LinkedItems
from mpic.linker.scout import ScoutTask
from mpic.linker.selective_prefill import LayerHook
from mpic.types import CacheEntry, LinkPlan


class Policy(ABC):
    """Chooses which tokens the selective prefill recomputes, and at how many layers."""

    name: str = ""
    two_step: bool = False
    """True: the text tokens' KV is computed first, in a pass of their own without the items."""

    @abstractmethod
    def depths(
        self, plan: LinkPlan, entries: Sequence[CacheEntry], num_layers: int
    ) -> torch.Tensor:
        """int64 [N] recompute depth of every token (entries aligned with `plan.entry_ids`)."""

    def layer_hook(self, plan: LinkPlan, num_layers: int) -> LayerHook | None:
        """A selection made during the pass, or None (the default: the plan decides)."""
        return None

    @property
    def scouts(self) -> bool:
        """True: the final depths come from a scout (`scout_task`, then `select`: the scout
        stage of the link pass, `mpic.linker.pipeline.link_pass`); `depths` then gives the
        scout's own tokens."""
        return False

    def scout_task(
        self,
        adapter: LayerAdapter,
        plan: LinkPlan,
        entries: Sequence[CacheEntry],
        linked_kv: LinkedKV,
        items: LinkedItems | None = None,
        offset: int = 0,
    ) -> ScoutTask:
        """Scouting policies: this request's share of the link pass's one scouting pass
        (`mpic.linker.scout.scout_pass`) over `plan` (the pre-scout depths), every item linked
        into `linked_kv` (the request's own). items: the item K/V just linked
        (`mpic.linker.link.linked_items`, every item), whose keys the scout scores (None: rotated
        again from the entries); offset: the request's first index in the linked KV the pass
        runs over (a batch's stacked one)."""
        raise NotImplementedError(f"{self.name} does not scout")

    def select(
        self,
        plan: LinkPlan,
        entries: Sequence[CacheEntry],
        scores: torch.Tensor,
        num_layers: int,
        cached_prefix: int = 0,
    ) -> torch.Tensor:
        """Scouting policies: the final int64 [N] depths from the scout's scores float32 [N].
        cached_prefix: leading tokens linked exactly (`mpic.linker.prefix`), depth 0 and
        outside the budget."""
        raise NotImplementedError(f"{self.name} does not scout")

    @property
    def corrects(self) -> bool:
        """True when `correction` returns one (engines then keep K/V mirrors where their cache
        cannot be read; the vLLM worker)."""
        return False

    def correction(
        self, plan: LinkPlan, num_layers: int, entries: Sequence[CacheEntry] = ()
    ) -> LinkCorrection | None:
        """The APE-style correction of linked keys for `plan` (final depths; `entries` aligned
        with the plan's), or None (the default: plain attention)."""
        return None

    def with_scales(self, scales: Sequence[Sequence[float]] | None) -> Policy:
        """This policy under a model's own (budget, S) table (`mpic model calibrate-scout`;
        None: the default tables): what `get_policy(name, scales=scales)` gives for the name it
        was parsed from, without parsing it again (an engine resolves a policy parsed elsewhere,
        the Resolver replica's, against its model). Itself for every policy whose S, if any, was
        not taken from the default tables."""
        return self

    def apply(self, plan: LinkPlan, entries: Sequence[CacheEntry], num_layers: int) -> LinkPlan:
        """A copy of `plan` with this policy's depths (last token always at depth L)."""
        depth = self.depths(plan, entries, num_layers).to(torch.int64).clamp(0, num_layers)
        depth[-1] = num_layers
        return dataclasses.replace(plan, recompute_depth=depth)


def text_depths(plan: LinkPlan, num_layers: int) -> torch.Tensor:
    """int64 [N]: L for text tokens (no stored KV: always recomputed), 0 for item tokens."""
    return torch.where(plan.is_text, num_layers, 0).to(torch.int64)


def entry_token_counts(plan: LinkPlan, entries: Sequence[CacheEntry]) -> torch.Tensor:
    """int64 [N]: T of the entry each item token comes from (0 for text)."""
    counts = torch.tensor([e.num_tokens for e in entries] + [0], dtype=torch.int64)
    return counts[plan.source_entry]  # source -1 picks the trailing 0
