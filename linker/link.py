"""Filling a linked KV from cache entries (linker; reference runner and vLLM worker).

Item tokens that are not recomputed at every layer get their entry's cached K/V (all entries and
layers of a request in a few tensor ops), the keys rotated from the canonical positions to the
prompt's by R(p_new - p_old) (`mpic.kernels.rope`); text slots stay the dummy (zero) cache of
paper section 4.1 and are filled by the selective prefill. Also gathers the input embeddings of
recomputed tokens: text from the embedding table, item tokens from the entry's stored
`input_embeds` (no vision tower at link time).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mpic.kernels.rope import rotate_keys
from mpic.linker.contracts import LayerAdapter
from mpic.linker.linked_kv import LinkedKV
from mpic.model_spec import RopeSpec
from mpic.types import CacheEntry, LinkPlan


@dataclass
class LinkedItems:
    """Item tokens' cached K/V as linked into one prompt (`linked_items`)."""

    slots: torch.Tensor
    """int64 [M]: their prompt indices (grouped by entry, ascending within one)."""
    keys: torch.Tensor
    """[L, M, H_kv, D]: keys rotated from the canonical positions to the prompt's."""
    values: torch.Tensor
    """[L, M, H_kv, D]."""

    def write_to(self, linked_kv: LinkedKV) -> int:
        """Write every layer of them into `linked_kv` in ONE `write_layers` call (the linked KV
        moves them to its own device); returns the number of token slots linked."""
        linked_kv.write_layers(self.slots, self.keys, self.values)
        return int(self.slots.numel())


def linked_items(
    plan: LinkPlan,
    entries: Sequence[CacheEntry],
    rope: RopeSpec,
    num_layers: int,
    every_item: bool = False,
    device: torch.device | str | None = None,
) -> LinkedItems | None:
    """Rotated cached K/V of the item tokens with recompute_depth < L (every item token when
    `every_item`: a policy that drops tokens inside the pass, such as CacheBlend, needs cached
    KV under all of them, and a scout reads all their keys); None when there are none.

    In bulk: one gather per entry (all layers at once) and ONE RoPE-delta rotation of the keys of
    all entries ([L, S, H_kv, D]; 1-D RoPE or M-RoPE), so the work is a few tensor ops whatever
    the number of entries and layers. The plan's tensors are host tensors: the slot selection
    costs no device sync. device: where to rotate (default: the first entry's device).
    entries: aligned with `plan.entry_ids`.
    """
    reused = plan.recompute_depth < num_layers
    if every_item:
        reused = torch.ones_like(reused)
    chosen = reused & (plan.source_entry >= 0)
    if not bool(chosen.any()):
        return None
    target = torch.device(device) if device is not None else entries[0].keys.device
    slot_parts, key_parts, value_parts, old_parts = [], [], [], []
    for e_idx, entry in enumerate(entries):
        slots = torch.nonzero(chosen & (plan.source_entry == e_idx)).flatten()
        if slots.numel() == 0:
            continue
        offsets = plan.source_offset[slots]
        slot_parts.append(slots)
        old_parts.append(entry.positions.cpu()[..., offsets])
        offsets = offsets.to(entry.keys.device)
        key_parts.append(entry.keys[:, offsets].to(target))  # [L, S_e, H_kv, D]
        value_parts.append(entry.values[:, offsets].to(target))
    slots = torch.cat(slot_parts)
    keys = rotate_keys(
        torch.cat(key_parts, dim=1),
        torch.cat(old_parts, dim=-1),
        plan.positions[..., slots],
        rope,
    )
    return LinkedItems(slots, keys, torch.cat(value_parts, dim=1))


def link_entries(
    linked_kv: LinkedKV,
    plan: LinkPlan,
    entries: Sequence[CacheEntry],
    rope: RopeSpec,
    num_layers: int,
    every_item: bool = False,
    device: torch.device | str | None = None,
) -> int:
    """Write rotated cached K/V of item tokens into `linked_kv` (`linked_items`, then
    `LinkedItems.write_to`). Returns the number of token slots linked."""
    items = linked_items(plan, entries, rope, num_layers, every_item, device)
    return items.write_to(linked_kv) if items is not None else 0


def gather_input_embeds(
    adapter: LayerAdapter, plan: LinkPlan, entries: Sequence[CacheEntry], index: torch.Tensor
) -> torch.Tensor:
    """Input embeddings [S, hidden] of the tokens at prompt indices `index` (int64 [S])."""
    # Row positions are found on the host and written with integer indices: a boolean index on
    # the device would read its positions back (a sync per entry).
    index = index.cpu()  # the plan's tensors live on the host
    src = plan.source_entry[index]
    text = src < 0
    text_rows = text.nonzero().squeeze(1)
    text_embeds = adapter.embed_tokens(plan.token_ids[index][text].to(adapter.device))
    out = torch.empty(
        (index.shape[0], text_embeds.shape[-1]), dtype=adapter.dtype, device=adapter.device
    )
    out[text_rows.to(adapter.device)] = text_embeds.to(adapter.dtype)
    offsets_all = plan.source_offset[index]
    for e_idx in torch.unique(src[~text]).tolist():
        rows = (src == e_idx).nonzero().squeeze(1)
        embeds = entries[e_idx].input_embeds[offsets_all[rows]].to(adapter.device, adapter.dtype)
        out[rows.to(adapter.device)] = embeds
    return out
