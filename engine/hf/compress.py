"""Glue between the reference runner's dense linked KV and the presses (reference-runner
process): observe the linked prefill, then replace the dense KV by a `CompressedKV`.

link -> recompute (the selective prefill, observed) -> compress (the press) -> decode over the
compressed KV. The dense [L, N + max_new, H_kv, D] tensors are released once compressed, so the
memory held while decoding is the `CompressedKV`'s.

The uniform-across-layers variant on cached items (`mpic.presses.entries`) is driven from here
for both engines: `canonical_planned` + `press_item_entry` run the item's canonical prefill
(observed) over any `LayerAdapter` and `LinkedKV` (the reference runner's dense KV, or the vLLM
worker's paged blocks) and return the compressed entry.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mpic.linker.dense_kv import DenseLinkedKV
from mpic.linker.pipeline import link_and_prefill
from mpic.linker.plan import build_plan
from mpic.linker.policies import get_policy
from mpic.linker.positions import next_position
from mpic.linker.prompt import DOCUMENT_PLACEHOLDER
from mpic.linker.recipe import PlannedPrompt
from mpic.model_spec import ModelSpec
from mpic.presses.base import BasePress, PressContext
from mpic.presses.cache import CompressedKV
from mpic.presses.entries import compress_entry
from mpic.presses.observe import ObservedAdapter, ObservedKV, PrefillObserver
from mpic.presses.registry import check_budget, get_press
from mpic.types import CacheEntry, LinkPlan


@dataclass
class PressRequest:
    """A press applied to one request: its object (fresh per request) and budget."""

    press: BasePress
    budget: float

    @classmethod
    def make(cls, name: str | None, budget: float | None) -> PressRequest | None:
        """None when no press or budget 1.0 (nothing to compress: bit-identical decoding);
        ValueError for an unknown press or a budget outside (0, 1]."""
        if name is None:
            if budget is not None and check_budget(budget) < 1.0:
                raise ValueError("budget given without a press")
            return None
        press = get_press(name)
        b = check_budget(1.0 if budget is None else budget)
        return None if b >= 1.0 else cls(press, b)


def observer_for(plan: LinkPlan, adapter, window: int = 64) -> PrefillObserver:  # noqa: ANN001
    """A fresh observer for this prompt (is_visual: tokens from entries)."""
    return PrefillObserver(
        adapter.num_layers, plan.num_tokens, adapter.num_kv_heads, plan.source_entry >= 0, window
    )


def observed(adapter, kv: DenseLinkedKV, observer: PrefillObserver):  # noqa: ANN001, ANN201
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


def compress_dense(
    req: PressRequest,
    kv: DenseLinkedKV,
    observer: PrefillObserver,
    plan: LinkPlan,
    adapter,  # noqa: ANN001
    extra: int,
) -> CompressedKV:
    """The press over every layer of the prefilled dense KV -> a CompressedKV with room for
    `extra` decoded tokens. The caller drops `kv` afterwards."""
    n = plan.num_tokens
    keys = [kv.keys[layer, :n].transpose(0, 1) for layer in range(adapter.num_layers)]
    values = [kv.values[layer, :n].transpose(0, 1) for layer in range(adapter.num_layers)]
    ctx = press_context(plan, adapter)
    with torch.inference_mode():
        return req.press.compress(keys, values, observer.layers, ctx, req.budget, extra)


def dense_nbytes(kv: DenseLinkedKV) -> int:
    """Bytes of a dense linked KV's storage (K and V)."""
    return kv.keys.nbytes + kv.values.nbytes


def canonical_planned(spec: ModelSpec, entry: CacheEntry) -> PlannedPrompt:
    """The item's canonical prompt (its `extra["context_token_ids"]` + the item's T tokens, what
    the entry was computed over) linking the entry under policy `full` (every token recomputed
    in every layer: a plain prefill whose attention the observer sees in full)."""
    context = entry.extra.get("context_token_ids")
    if context is None:
        raise ValueError(f"entry {entry.entry_id!r} records no canonical context")
    placeholder = DOCUMENT_PLACEHOLDER if entry.media_type == "text" else spec.image_token_id
    plan = build_plan(spec, [*context, placeholder], [entry])
    policy = get_policy("full")
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


def press_entry_dense(
    adapter,  # noqa: ANN001
    spec: ModelSpec,
    entry: CacheEntry,
    press: str,
    budget: float,
    backend: str | None = None,
) -> CacheEntry:
    """`press_item_entry` over a fresh dense KV (the reference runner's variant)."""
    planned = canonical_planned(spec, entry)
    a = adapter
    kv = DenseLinkedKV(
        a.num_layers,
        planned.plan.num_tokens,
        a.num_kv_heads,
        a.head_dim,
        a.dtype,
        a.device,
        backend=backend,
    )
    return press_item_entry(a, planned, kv, press, budget)
