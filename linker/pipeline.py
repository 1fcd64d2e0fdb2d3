"""Link and prefill one prompt under a policy (linker; reference runner, and any engine that
brings its own LayerAdapter and LinkedKV).

The plan's depths come set from `mpic.linker.recipe`, final for every policy but a scouting one
(`scout-*`, the default `auto`), which is applied again here (its scout's tokens) before its
scout sets the final depths. Order: run the text-first pass of two-step policies, link the
entries' rotated KV (`linked_items`, every item for a scout, which then scores those very keys),
for a scouting policy run the scout over the text and let the policy set the final depths
(`mpic.linker.scout`), hand the policy's linked-key
correction to the linked KV, gather the recomputed tokens' input embeddings, run the one-pass
selective prefill (with the policy's in-pass hook, if any). With a cached prefix
(`mpic.linker.prefix`) its exact KV is written with the entries' and its tokens get depth 0
(not recomputed; a scouting policy spends their share of the budget on item tokens).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch

from mpic.linker.contracts import LayerAdapter
from mpic.linker.link import gather_input_embeds, linked_items
from mpic.linker.linked_kv import LinkedKV
from mpic.linker.recipe import PlannedPrompt
from mpic.linker.scout import ScoutReport
from mpic.linker.selective_prefill import LayerHook, PrefillResult, selective_prefill
from mpic.linker.two_step import prefill_text_first
from mpic.types import LinkPlan

logger = logging.getLogger(__name__)


@dataclass
class LinkedPrefill:
    """The outcome of `link_and_prefill`."""

    plan: LinkPlan
    """The plan with the policy's recompute depths."""
    result: PrefillResult
    recomputed_tokens: int
    """Prompt tokens that ran through at least one layer, over both steps of two-step policies."""
    scout: ScoutReport | None = None
    """The scouting pass's cost (scouting policies only)."""
    cached_prefix: int = 0
    """Leading prompt tokens linked exactly from the prefix cache (`mpic.linker.prefix`):
    depth 0, not recomputed, counted as cached."""


@dataclass
class PreparedPass:
    """A prompt ready for its selective pass (`prepare_pass`): its linked KV written, its final
    depths set, the recomputed tokens' inputs gathered. `link_and_prefill` runs it alone; the
    vLLM worker's `link_batch` runs several requests' together."""

    plan: LinkPlan
    """The plan with the final depths (the scout's, the cached prefix excluded)."""
    index: torch.Tensor
    """int64 [S] (host): prompt indices of the recomputed tokens, ascending."""
    embeds: torch.Tensor
    """[S, hidden]: their input embeddings."""
    hook: LayerHook | None
    """The policy's in-pass selection (CacheBlend), or None."""
    ran: torch.Tensor
    """bool [N]: tokens a text-first pass already ran (two-step policies)."""
    scout: ScoutReport | None = None
    cached_prefix: int = 0


def prepare_pass(
    adapter: LayerAdapter, planned: PlannedPrompt, linked_kv: LinkedKV
) -> PreparedPass:
    """Everything before the selective pass, in the order of the module docstring: the
    text-first pass (two-step policies), the entries' rotated KV and the cached prefix written
    into `linked_kv` (zeroed, at least N slots), the scout's depths (scouting policies), the
    linked-key correction handed to `linked_kv`, the recomputed tokens' input embeddings."""
    plan, entries, policy = planned.plan, planned.entries, planned.policy
    if policy.scouts:  # a plan carrying an earlier run's final depths scouts from scratch
        plan = policy.apply(plan, entries, adapter.num_layers)
    ran = torch.zeros(plan.num_tokens, dtype=torch.bool)
    if policy.two_step:
        prefill_text_first(adapter, plan, linked_kv)
        ran |= plan.is_text
    hook = policy.layer_hook(plan, adapter.num_layers)
    items = linked_items(
        plan,
        entries,
        adapter.rope,
        adapter.num_layers,
        every_item=hook is not None or policy.scouts,
        device=adapter.device,  # rotate where the model runs (entries may come from storage)
    )
    if items is not None:
        items.write_to(linked_kv)
    prefix = planned.prefix if not policy.two_step and hook is None else None
    cached = prefix.length if prefix is not None else 0
    if prefix is not None:  # two-step and in-pass-hook policies recompute it
        prefix.write(linked_kv)
    report = None
    if policy.scouts:
        # the scout scores the item keys just linked (rotated once, for both)
        depth, report = policy.scout(adapter, plan, entries, linked_kv, cached, items)
        plan = dataclasses.replace(plan, recompute_depth=depth)
    if prefix is not None:
        plan = prefix.exclude(plan)  # linked exactly from the prefix cache
    correction = policy.correction(plan, adapter.num_layers)
    if correction is not None:
        set_correction = getattr(linked_kv, "set_correction", None)
        if set_correction is None:
            logger.warning("%s: this linked KV has no correction; plain attention", policy.name)
        else:
            set_correction(correction)
    index = torch.nonzero(plan.recompute_depth > 0).flatten()
    embeds = gather_input_embeds(adapter, plan, entries, index)
    return PreparedPass(plan, index, embeds, hook, ran, report, cached)


def link_and_prefill(
    adapter: LayerAdapter, planned: PlannedPrompt, linked_kv: LinkedKV
) -> LinkedPrefill:
    """Fill `linked_kv` for the prompt and return the last token's logits (`prepare_pass`, then
    the selective pass).

    planned: from `mpic.linker.recipe` (the policy's depths are set; a scouting policy's are
    applied again here and replaced by its scout's selection);
    linked_kv: zeroed, at least N slots.
    """
    prepared = prepare_pass(adapter, planned, linked_kv)
    result = selective_prefill(
        adapter, prepared.plan, linked_kv, prepared.embeds, hook=prepared.hook
    )
    return LinkedPrefill(
        plan=prepared.plan,
        result=result,
        recomputed_tokens=int((prepared.ran | (result.recompute_depth > 0)).sum()),
        scout=prepared.scout,
        cached_prefix=prepared.cached_prefix,
    )
