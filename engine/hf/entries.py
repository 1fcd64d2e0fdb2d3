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
address names the processed content). Nothing is written here: storage persists entries.
"""

from __future__ import annotations

from typing import Any

import torch

from mpic.addressing import entry_address
from mpic.engine.hf.vision import encode, load_image
from mpic.errors import PromptTooLongError
from mpic.linker.contracts import LayerAdapter
from mpic.linker.dense_kv import DenseLinkedKV
from mpic.linker.positions import image_positions, text_positions
from mpic.linker.prompt import (
    ChatTokenizer,
    canonical_context_ids,
    document_context_ids,
    document_token_ids,
)
from mpic.linker.selective_prefill import run_layers
from mpic.model_spec import ModelSpec
from mpic.types import CacheEntry


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

    Raises UnreadableMediaError (before any computation) when the bytes are not an image.
    """
    image = load_image(media)
    context_ids = canonical_context_ids(processor, system_prompt, spec.image_token_id)
    entry_id = entry_address(spec.fingerprint, context_ids, media)
    (features,) = encode(model, processor, [image])
    return compute_entry(
        adapter, spec, context_ids, features.embeds, entry_id, grid_thw=features.grid_thw
    )


def document_bytes(text: str) -> bytes:
    """What a document's content address hashes: b"text:" + its UTF-8 bytes."""
    return b"text:" + text.encode("utf-8")


def document_item(
    tokenizer: ChatTokenizer,
    spec: ModelSpec,
    text: str,
    system_prompt: str | None = None,
    max_len: int | None = None,
) -> tuple[list[int], list[int], str]:
    """(token ids, canonical context ids, entry id) of a text document: what every engine
    caches for it (the reference runner here, vLLM's upload path in `mpic.engine.vllm`).
    InvalidRequestError for an empty document; PromptTooLongError when context + tokens exceed
    `max_len` (default: the model's maximum length)."""
    limit = max_len or spec.max_model_len
    ids = document_token_ids(tokenizer, text)
    context_ids = document_context_ids(tokenizer, system_prompt)
    if len(context_ids) + len(ids) > limit:
        raise PromptTooLongError(
            f"the document has {len(ids)} tokens; with its context that is over the model's "
            f"maximum of {limit}",
            param="file",
        )
    return ids, context_ids, entry_address(spec.fingerprint, context_ids, document_bytes(text))


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


def line_break_offsets(tokenizer: ChatTokenizer, token_ids: list[int]) -> list[int]:
    """Offsets of the tokens whose text holds a line break (the `boundary-k` policy recomputes
    them: delimiters gather attention, docs/fidelity.md)."""
    tokenizer = getattr(tokenizer, "tokenizer", tokenizer)
    pieces = tokenizer.batch_decode([[t] for t in token_ids])
    return [i for i, piece in enumerate(pieces) if "\n" in piece]
