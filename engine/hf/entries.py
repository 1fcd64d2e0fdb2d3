"""Cache entries: the KV of one image or text document computed in the canonical context
(docs/design.md "Cache entry"; runs where entries are made: the LLM worker on upload, the
reference runner, benchmarks).

A document is an item like an image: its token ids (the text tokenized alone,
`mpic.linker.prompt.document_token_ids`) are cached after the document's canonical context
(`document_context_ids`), its input embeddings are the token embeddings, its positions text
positions, and `extra["token_ids"]` keeps the ids the plan puts in the prompt. Its id is the
content address of b"text:" + the UTF-8 text, so a document never shares an address with an
image of the same bytes.

Canonical context = the chat template's system prompt and the start of a user turn whose first
part is the image (`mpic.linker.prompt.canonical_context_ids`). The image's input embeddings come
from the model's own processor and vision tower (`mpic.engine.hf.vision.encode`: the image as
the processor lays it out, so T and, for M-RoPE, the grid are the image's own); the context +
image run through the model with the one-pass layer loop (every token computed, so it is a
plain prefill), and the image tokens' post-RoPE K/V, positions and embeddings make the entry.
Its id is the content address sha256(model fingerprint, canonical context, media bytes)
(`mpic.addressing.entry_address`; the fingerprint covers the image processor's settings, so the
address names the processed content). The model-free part of an item (decoding, token ids,
content address: `mpic.engine.items`) is shared with vLLM's upload path. Nothing is written here:
storage persists entries.
"""

from __future__ import annotations

from typing import Any

import torch

from mpic.engine.hf.vision import encode
from mpic.engine.items import (
    check_item_length,
    document_bytes,
    document_item,
    image_item,
    line_break_offsets,
)
from mpic.linker.contracts import LayerAdapter
from mpic.linker.kv.dense import DenseLinkedKV
from mpic.linker.positions import image_positions, text_positions
from mpic.linker.prompt import ChatTokenizer
from mpic.linker.selective_prefill import run_layers
from mpic.model_spec import ModelSpec
from mpic.types import CacheEntry

__all__ = [  # the items' forms (`mpic.engine.items`) are re-exported with the entries
    "cache_document",
    "cache_image",
    "compute_entry",
    "document_bytes",
    "document_item",
    "line_break_offsets",
]


def compute_entry(
    adapter: LayerAdapter,
    spec: ModelSpec,
    context_ids: list[int],
    image_embeds: torch.Tensor,
    entry_id: str,
    document_ids: list[int] | None = None,
    grid_thw: tuple[int, int, int] | None = None,
) -> CacheEntry:
    """The entry of an item with input embeddings image_embeds [T, hidden], computed after
    the canonical context `context_ids` (keys post-RoPE at the canonical positions).
    document_ids: the item is a text document with these T token ids (text positions,
    media_type "text"); None: an image (the family's image positions). grid_thw: the image's
    (t, h, w) patch grid before the merge (M-RoPE families; `vision.encode` gives it), kept in
    `extra["image_grid_thw"]`: each image has its own T and grid."""
    c, t = len(context_ids), int(image_embeds.shape[0])
    if document_ids is not None:
        item_pos = text_positions(spec.family, c, t)
    else:
        item_pos = image_positions(spec.family, c, t, grid_thw, spec.spatial_merge_size or 1)
    positions = torch.cat([text_positions(spec.family, 0, c), item_pos], dim=-1)
    kv = DenseLinkedKV(
        adapter.num_layers,
        c + t,
        adapter.num_kv_heads,
        adapter.head_dim,
        adapter.dtype,
        adapter.device,
    )
    with torch.inference_mode():  # every tensor the layers see is an inference tensor, as in
        # a prefill (a compiled layer step would otherwise keep one more graph for the other kind)
        embeds = torch.cat(
            [
                adapter.embed_tokens(torch.tensor(context_ids, dtype=torch.int64)),
                image_embeds.to(adapter.device, adapter.dtype),
            ]
        )
        run_layers(
            adapter,
            kv,
            embeds,
            torch.arange(c + t),
            positions,
            torch.full((c + t,), adapter.num_layers, dtype=torch.int64),
            outputs=torch.zeros(c + t, dtype=torch.bool),  # their KV alone is read
        )
    extra: dict[str, Any] = {"context_token_ids": list(context_ids)}
    if document_ids is not None:
        extra["token_ids"] = list(document_ids)
    elif grid_thw is not None:
        extra["image_grid_thw"] = [int(x) for x in grid_thw]
    return CacheEntry(
        media_type="image" if document_ids is None else "text",
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

    Raises UnreadableMediaError (before any computation) when the bytes are not an image,
    PromptTooLongError when its canonical context and tokens exceed the model's maximum length.
    """
    image, context_ids, entry_id = image_item(processor, spec, media, system_prompt)
    (features,) = encode(model, processor, [image])
    check_item_length("image", len(context_ids), int(features.embeds.shape[0]), spec.max_model_len)
    return compute_entry(
        adapter, spec, context_ids, features.embeds, entry_id, grid_thw=features.grid_thw
    )


def cache_document(
    tokenizer: ChatTokenizer,
    adapter: LayerAdapter,
    spec: ModelSpec,
    text: str,
    system_prompt: str | None = None,
) -> CacheEntry:
    """Tokenize and compute the entry of one text document (an uploaded .txt/.md file or a
    library passage). InvalidRequestError for an empty document; PromptTooLongError when its
    canonical context + tokens exceed the model's maximum length (before any computation)."""
    ids, context_ids, entry_id = document_item(tokenizer, spec, text, system_prompt)
    embeds = adapter.embed_tokens(torch.tensor(ids, dtype=torch.int64))
    entry = compute_entry(adapter, spec, context_ids, embeds, entry_id, document_ids=ids)
    entry.extra["line_breaks"] = line_break_offsets(tokenizer, ids)
    return entry
