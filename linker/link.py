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
from mpic.linker.kv.linked import LinkedKV
from mpic.linker.sources import SourceGroup, group_by_source, take
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

    In bulk: the slots grouped by entry once (`mpic.linker.sources`), one slice (or, for
    scattered offsets, one gather) per entry for all layers at once, and ONE RoPE-delta rotation
    of the keys of all entries ([L, S, H_kv, D]; 1-D RoPE or M-RoPE), so the work is a few
    tensor ops per entry whatever the number of layers. The plan's tensors are host tensors:
    the slot selection costs no device sync. device: where to rotate (default: the first
    entry's device). entries: aligned with `plan.entry_ids`.
    """
    reused = plan.recompute_depth < num_layers
    chosen = (plan.source_entry >= 0) if every_item else reused & (plan.source_entry >= 0)
    slots = torch.nonzero(chosen).flatten()
    if slots.numel() == 0:
        return None
    target = torch.device(device) if device is not None else entries[0].keys.device
    grouped = group_by_source(plan.source_entry[slots], plan.source_offset[slots])
    scattered = not all(g.contiguous for g in grouped.groups)
    on_entries = grouped.offsets.to(entries[0].keys.device) if scattered else None
    key_parts, value_parts, old_parts = [], [], []
    for group in grouped.groups:
        entry = entries[group.source]
        old_parts.append(take(entry.positions.cpu(), group, grouped.offsets, dim=-1))
        key_parts.append(_to(take(entry.keys, group, on_entries, dim=1), target))  # [L, S_e, H, D]
        value_parts.append(_to(take(entry.values, group, on_entries, dim=1), target))
    slots = slots[grouped.order]
    keys = rotate_keys(
        cat_parts(key_parts, dim=1), cat_parts(old_parts, dim=-1), plan.positions[..., slots], rope
    )
    return LinkedItems(slots, keys, cat_parts(value_parts, dim=1))


def cat_parts(parts: list[torch.Tensor], dim: int = 0) -> torch.Tensor:
    """One `cat` of the parts (none for one part: the part itself)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)


def _to(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`t` on `device` (no op where it is)."""
    return t if t.device == device else t.to(device)


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
    """Input embeddings [S, hidden] of the tokens at prompt indices `index` (int64 [S]).

    The rows are grouped by source on the host (`mpic.linker.sources`): the text rows are
    embedded in one lookup, each entry's rows are a slice of its `input_embeds` (or one gather,
    for scattered offsets), ONE `cat` joins them and, where grouping moved rows, one gather puts
    them back in `index` order. The offsets and the way back reach the device in one copy;
    nothing is read back (a boolean index on the device would read its positions back: a
    sync)."""
    index = index.cpu()  # the plan's tensors live on the host
    sources = plan.source_entry[index]
    if index.numel() == 0 or bool((sources < 0).all()):  # text only (a scout's rows): one lookup
        return adapter.embed_tokens(plan.token_ids[index].to(adapter.device))
    grouped = group_by_source(sources, plan.source_offset[index])
    back = None if grouped.in_input_order() else torch.argsort(grouped.order)
    tables = [entries[g.source].input_embeds for g in grouped.groups if not _sliced(g)]
    offsets = None
    if tables and tables[0].device == adapter.device and back is not None:
        # one host-to-device copy: the scattered groups' offsets and the way back
        both = torch.cat([grouped.offsets, back]).to(adapter.device)
        offsets, back = both[: len(index)], both[len(index) :]
    elif tables:
        offsets = grouped.offsets.to(tables[0].device)
    pieces = []
    for group in grouped.groups:
        if group.source < 0:
            rows = index[grouped.order[group.start : group.end]]
            piece = adapter.embed_tokens(plan.token_ids[rows].to(adapter.device))
        else:
            piece = take(entries[group.source].input_embeds, group, offsets)
        pieces.append(_cast(piece, adapter.device, adapter.dtype))
    embeds = cat_parts(pieces, dim=0)
    return embeds if back is None else embeds[back.to(adapter.device)]


def _sliced(group: SourceGroup) -> bool:
    """Whether `take` reads the group without offsets (text, or one range of an entry)."""
    return group.source < 0 or group.contiguous


def _cast(t: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """`t` on `device` in `dtype` (no op where it is)."""
    return t if t.device == device and t.dtype == dtype else t.to(device, dtype)
