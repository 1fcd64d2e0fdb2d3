"""Cache entries: the KV of one image computed in the canonical context (docs/design.md "Cache
entry"; runs where entries are made: the LLM worker on upload, the reference runner, benchmarks).

Canonical context = the chat template's system prompt and the start of a user turn whose first
part is the image (`mpic.linker.prompt.canonical_context_ids`). The image's input embeddings come
from the model's own vision tower (`mpic.engine.hf.vision.encode_images`); the context + image run
through the model with the one-pass layer loop (every token computed, so it is a plain prefill),
and the image tokens' post-RoPE K/V, positions and embeddings make the entry. Its id is the
content address sha256(model fingerprint, canonical context, media bytes)
(`mpic.addressing.entry_address`). Nothing is written here: storage persists entries.
"""

from __future__ import annotations

from typing import Any

import torch

from mpic.addressing import entry_address
from mpic.engine.hf.vision import encode_images, load_image
from mpic.linker.contracts import LayerAdapter
from mpic.linker.dense_kv import DenseLinkedKV
from mpic.linker.positions import image_positions, text_positions
from mpic.linker.prompt import ChatTokenizer, canonical_context_ids
from mpic.linker.selective_prefill import run_layers
from mpic.model_spec import ModelSpec
from mpic.types import CacheEntry


def compute_entry(
    adapter: LayerAdapter,
    spec: ModelSpec,
    context_ids: list[int],
    image_embeds: torch.Tensor,
    entry_id: str,
) -> CacheEntry:
    """The entry of an image with input embeddings image_embeds [T, hidden], computed after
    the canonical context `context_ids` (keys post-RoPE at the canonical positions)."""
    c, t = len(context_ids), int(image_embeds.shape[0])
    positions = torch.cat(
        [
            text_positions(spec.family, 0, c),
            image_positions(spec.family, c, t, spec.image_grid_thw, spec.spatial_merge_size or 1),
        ],
        dim=-1,
    )
    kv = DenseLinkedKV(
        adapter.num_layers,
        c + t,
        adapter.num_kv_heads,
        adapter.head_dim,
        adapter.dtype,
        adapter.device,
    )
    embeds = torch.cat(
        [
            adapter.embed_tokens(torch.tensor(context_ids, dtype=torch.int64)),
            image_embeds.to(adapter.device, adapter.dtype),
        ]
    )
    with torch.inference_mode():
        run_layers(
            adapter,
            kv,
            embeds,
            torch.arange(c + t),
            positions,
            torch.full((c + t,), adapter.num_layers, dtype=torch.int64),
        )
    extra: dict[str, Any] = {"context_token_ids": list(context_ids)}
    if spec.image_grid_thw is not None:
        extra["image_grid_thw"] = list(spec.image_grid_thw)
    return CacheEntry(
        entry_id=entry_id,
        model_fingerprint=spec.fingerprint,
        keys=kv.keys[:, c:].clone(),
        values=kv.values[:, c:].clone(),
        positions=positions[..., c:].clone(),
        input_embeds=image_embeds.detach().clone(),
        extra=extra,
    )


def cache_image(
    model: Any,
    processor: ChatTokenizer,
    adapter: LayerAdapter,
    spec: ModelSpec,
    media: bytes,
    system_prompt: str | None = None,
) -> CacheEntry:
    """Decode, encode and compute the entry of one image given as bytes.

    Raises UnreadableMediaError (before any computation) when the bytes are not an image.
    """
    image = load_image(media)
    context_ids = canonical_context_ids(processor, system_prompt, spec.image_token_id)
    entry_id = entry_address(spec.fingerprint, context_ids, media)
    (embeds,) = encode_images(model, processor, [image])
    return compute_entry(adapter, spec, context_ids, embeds, entry_id)
