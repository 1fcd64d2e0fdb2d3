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
        rows = _rows(offsets, entry.keys.device)
        positions = (
            entry.positions if entry.positions.device.type == "cpu" else entry.positions.cpu()
        )
        old_parts.append(positions[..., rows if isinstance(rows, slice) else offsets])
        key_parts.append(_to(entry.keys[:, rows], target))  # [L, S_e, H_kv, D]
        value_parts.append(_to(entry.values[:, rows], target))
    slots = torch.cat(slot_parts)
    keys = rotate_keys(
        torch.cat(key_parts, dim=1),
        torch.cat(old_parts, dim=-1),
        plan.positions[..., slots],
        rope,
    )
    return LinkedItems(slots, keys, torch.cat(value_parts, dim=1))


def _rows(offsets: torch.Tensor, device: torch.device) -> slice | torch.Tensor:
    """An entry's rows to link (host int64 offsets, ascending): a slice when they are one
    contiguous range (mpic-k, full reuse: every row from the k-th on), so the entry's K/V are
    read in place by the one `cat` of all entries instead of being gathered first; else the
    offsets on the entry's device (a gather)."""
    n = int(offsets.numel())
    first = int(offsets[0])
    if int(offsets[-1]) - first + 1 == n and torch.equal(offsets, torch.arange(first, first + n)):
        return slice(first, first + n)
    return offsets.to(device)


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

    The rows fall into runs (consecutive text rows; rows of one entry at consecutive offsets:
    the first k tokens of an image), found on the host; each run is a slice of the text
    embeddings or of its entry's `input_embeds`, and ONE `cat` joins them: no index tensor is
    copied to the device and nothing is gathered or scattered row by row (a boolean index on
    the device would even read its positions back: a sync)."""
    index = index.cpu()  # the plan's tensors live on the host
    src = plan.source_entry[index]
    offsets = plan.source_offset[index]
    text = src < 0
    text_embeds = adapter.embed_tokens(plan.token_ids[index][text].to(adapter.device))
    text_embeds = _cast(text_embeds, adapter.device, adapter.dtype)
    n = int(index.shape[0])
    if n == 0:
        return text_embeds
    cut = (src[1:] != src[:-1]) | (~text[1:] & (offsets[1:] != offsets[:-1] + 1))
    edges = [0, *(torch.nonzero(cut).flatten() + 1).tolist(), n]
    starts = torch.tensor(edges[:-1])
    pieces, t = [], 0
    for (a, b), e, o in zip(
        zip(edges[:-1], edges[1:], strict=True),
        src[starts].tolist(),
        offsets[starts].tolist(),
        strict=True,
    ):
        if e < 0:
            pieces.append(text_embeds[t : t + b - a])
            t += b - a
        else:
            rows = entries[e].input_embeds[o : o + b - a]
            pieces.append(_cast(rows, adapter.device, adapter.dtype))
    return torch.cat(pieces)


def _cast(t: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """`t` on `device` in `dtype` (no op where it is)."""
    return t if t.device == device and t.dtype == dtype else t.to(device, dtype)
