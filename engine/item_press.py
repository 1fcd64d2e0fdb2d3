"""An item's compressed entry, the same for both engines (the reference runner's process, and
the MPIC connector's worker side in vLLM's worker process): the presses' uniform-across-layers
variant (`mpic.presses.entries`) chosen from the item's canonical prefill.

`canonical_planned` is the item's canonical prompt (its context + the item) linking its entry
under policy `full`; `press_item_entry` runs that prefill with the presses' observer over any
`LayerAdapter` and `LinkedKV` (the reference runner's dense KV, or vLLM's paged blocks) and
returns the compressed entry, so both engines choose the kept tokens from the same statistics.
The observer helpers (`observer_for`, `observed`, `press_context`) serve the reference runner's
per-request presses too (`mpic.engine.hf.compress`).
"""

from __future__ import annotations

import torch

from mpic.linker.pipeline import link_and_prefill
from mpic.linker.plan import build_plan
from mpic.linker.policies.full import FullPolicy
from mpic.linker.positions import next_position
from mpic.linker.prompt import DOCUMENT_PLACEHOLDER
from mpic.linker.recipe import PlannedPrompt
from mpic.model_spec import ModelSpec
from mpic.presses.base import PressContext
from mpic.presses.entries import compress_entry
from mpic.presses.observe import ObservedAdapter, ObservedKV, PrefillObserver
from mpic.presses.registry import check_budget, get_press
from mpic.types import CacheEntry, LinkPlan


def observer_for(plan: LinkPlan, adapter, window: int = 64) -> PrefillObserver:  # noqa: ANN001
    """A fresh observer for this prompt (is_visual: tokens from entries)."""
    return PrefillObserver(
        adapter.num_layers, plan.num_tokens, adapter.num_kv_heads, plan.source_entry >= 0, window
    )


def observed(adapter, kv, observer: PrefillObserver):  # noqa: ANN001, ANN201
    """(adapter, kv) wrapped so the prefill reports to `observer`."""
    return ObservedAdapter(adapter, observer), ObservedKV(kv, observer)


def press_context(plan: LinkPlan, adapter) -> PressContext:  # noqa: ANN001
    """The `PressContext` of a prefilled plan (visual = tokens from entries)."""
    return PressContext(
        num_tokens=plan.num_tokens,
        is_visual=plan.source_entry >= 0,
        next_position=next_position(plan.positions),
        mrope=plan.positions.dim() == 2,
        adapter=adapter,
    )


def canonical_planned(spec: ModelSpec, entry: CacheEntry) -> PlannedPrompt:
    """The item's canonical prompt (its `extra["context_token_ids"]` + the item's T tokens, what
    the entry was computed over) linking the entry under policy `full` (every token recomputed
    in every layer: a plain prefill whose attention the observer sees in full)."""
    context = entry.extra.get("context_token_ids")
    if context is None:
        raise ValueError(f"entry {entry.entry_id!r} records no canonical context")
    placeholder = DOCUMENT_PLACEHOLDER if entry.media_type == "text" else spec.image_token_id
    plan = build_plan(spec, [*context, placeholder], [entry])
    policy = FullPolicy()
    return PlannedPrompt(policy.apply(plan, [entry], spec.num_layers), [entry], policy, refs=[])


def press_item_entry(
    adapter,  # noqa: ANN001
    planned: PlannedPrompt,
    kv,  # noqa: ANN001
    press: str,
    budget: float,
) -> CacheEntry:
    """Run the canonical prefill `planned` (from `canonical_planned`) into `kv` (zeroed, >= N
    slots, readable keys) with the observer, let `press` choose the item's kept tokens from all
    layers' scores (`ScorerPress.uniform_keep`, span = the item) and return the compressed
    entry (`mpic.presses.entries.compress_entry`). No scorer reads values, so the keys stand in
    for them (a paged KV cannot be read back on CPU)."""
    p = get_press(press)
    b = check_budget(budget)
    plan, entry = planned.plan, planned.entries[0]
    n, t = plan.num_tokens, entry.num_tokens
    observer = observer_for(plan, adapter)
    obs_adapter, obs_kv = observed(adapter, kv, observer)
    with torch.inference_mode():
        link_and_prefill(obs_adapter, planned, obs_kv)
        index = torch.arange(n, device=adapter.device)
        keys = [kv.read_keys(layer, index).transpose(0, 1) for layer in range(adapter.num_layers)]
        ctx = press_context(plan, adapter)
        kept = p.uniform_keep(keys, keys, observer.layers, ctx, b, span=(n - t, n))
    return compress_entry(entry, kept, press, b)
