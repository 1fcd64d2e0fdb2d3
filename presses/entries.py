"""Compressed cache entries: the uniform-across-layers variant of a press applied to one item's
entry, so that every prompt linking it is shorter (any process that makes entries: the reference
runner, the vLLM worker through its connector, benchmarks).

Paged engines (vLLM) hold one block table and one sequence length per request for all layers and
heads, so a press there can only drop the SAME tokens from every layer. Applied to a cached item
(image or text document) this becomes a smaller entry: the press scores every token of the
item's canonical prefill (its canonical context + the item, every token computed: what the
entry was made from) in every layer, `ScorerPress.uniform_keep(span=item)` picks
C = max(1, round(b T)) of the item's T tokens from all layers' scores, and the compressed entry
keeps those tokens' K/V, canonical positions and input embeddings ([L, C, H_kv, D] ...).

Positions: the kept tokens keep their canonical positions in the entry (`positions`), and the
linker places an entry's C tokens at C consecutive prompt positions (1-D RoPE), rotating their
keys by R(p_new - p_old) like any linked key. So the kept tokens are re-rotated to contiguous
positions: the prompt, the paged KV and decoding all hold C tokens per item, and positions stay
consistent with the engine's own (vLLM decodes at position = token index). M-RoPE entries keep
their kept tokens' 3-D offsets (gaps included), which only the reference engine can express.

The compressed entry is stored beside the full one under `press_entry_id(entry_id, press,
budget)`; its `extra["press"]` records the source entry, press, budget and kept offsets.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch

from mpic.types import CacheEntry


def press_entry_id(entry_id: str, press: str, budget: float) -> str:
    """The content address of `entry_id` compressed by `press` at `budget` (sha256 hex, like
    every entry id; the budget as its shortest float repr)."""
    text = f"mpic-press\0{entry_id}\0{press}\0{float(budget)!r}"
    return hashlib.sha256(text.encode()).hexdigest()


def compress_entry(entry: CacheEntry, kept: torch.Tensor, press: str, budget: float) -> CacheEntry:
    """`entry` reduced to its item tokens `kept` (int64 [C] ascending offsets in 0..T-1, from
    `ScorerPress.uniform_keep(span=...)`): keys/values [L, C, H_kv, D], positions [C] or [3, C],
    input_embeds [C, hidden]; a document's `extra["token_ids"]` is reduced alike."""
    idx = kept.to(torch.int64).cpu()
    if idx.numel() == 0 or bool((idx[1:] <= idx[:-1]).any()) or int(idx[-1]) >= entry.num_tokens:
        raise ValueError("kept offsets must be ascending, unique and inside the entry")
    extra: dict[str, Any] = dict(entry.extra)
    if "token_ids" in extra:
        extra["token_ids"] = [extra["token_ids"][i] for i in idx.tolist()]
    extra["press"] = {
        "source": entry.entry_id,
        "press": press,
        "budget": float(budget),
        "kept": idx.tolist(),
        "source_tokens": entry.num_tokens,
    }
    dev = entry.keys.device
    return CacheEntry(
        entry_id=press_entry_id(entry.entry_id, press, budget),
        model_fingerprint=entry.model_fingerprint,
        keys=entry.keys[:, idx.to(dev)].contiguous(),
        values=entry.values[:, idx.to(dev)].contiguous(),
        positions=entry.positions[..., idx.to(entry.positions.device)].contiguous(),
        input_embeds=entry.input_embeds[idx.to(entry.input_embeds.device)].contiguous(),
        media_type=entry.media_type,
        extra=extra,
    )
