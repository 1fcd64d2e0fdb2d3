"""Image and document items as every engine caches them, without a model (any process that
caches items or plans prompts: CLI, benchmark, Serve replica; both backends import it).

- an image: its bytes decoded (`load_image`, 415 for bytes that are not an image) and laid out
  by the model folder's own processor (`image_layout`: T and, for M-RoPE, the grid, without
  running the tower; images are never resized here, `mpic.engine.hf.vision` says how each
  family lays them out); its canonical upload form (`image_item`: context ids + the content
  address, what the reference runner and vLLM's upload path both compute over);
- a text document: its token ids after its canonical context and its content address
  (`document_item`, over b"text:" + the UTF-8 text: never an image's address), and the offsets
  of its line-break tokens (`line_break_offsets`, read by the `boundary-k` policy).
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Any

from PIL import Image, UnidentifiedImageError

from mpic.addressing import entry_address
from mpic.errors import PromptTooLongError, UnreadableMediaError
from mpic.linker.prompt import (
    ChatTokenizer,
    canonical_context_ids,
    document_context_ids,
    document_token_ids,
)
from mpic.model_spec import ModelSpec


@dataclass(frozen=True)
class ImageLayout:
    """How many prompt tokens an image takes, and its M-RoPE grid (None for 1-D RoPE models)."""

    num_tokens: int
    grid_thw: tuple[int, int, int] | None = None
    """(t, h, w) in patches before the spatial merge (Qwen2-VL / Qwen2.5-VL)."""


def load_image(data: bytes) -> Image.Image:
    """Decode image bytes to an RGB PIL image; UnreadableMediaError if they are not an image."""
    if not data:
        raise UnreadableMediaError("empty upload: no image bytes")
    try:
        with Image.open(io.BytesIO(data)) as img:
            img.load()
            return img.convert("RGB")
    except (
        UnidentifiedImageError,
        OSError,
        SyntaxError,
        ValueError,
        Image.DecompressionBombError,
    ) as exc:
        raise UnreadableMediaError(f"the bytes are not a decodable image: {exc}") from exc


def is_qwen_processor(processor: Any) -> bool:
    """True for a Qwen2-VL / Qwen2.5-VL processor (its image processor merges patches)."""
    return hasattr(processor.image_processor, "merge_size")


def image_layout(processor: Any, image: Image.Image) -> ImageLayout:
    """T and grid of `image` as the model's own processor lays it out (`processor` is the
    folder's `AutoProcessor`): Qwen2-VL/2.5-VL from the image processor's grid; LLaVA and
    LLaVA-NeXT from the processor's own token-count rule (`_get_num_multimodal_tokens`, the one
    its `__call__` and vLLM use)."""
    image = image.convert("RGB")
    if is_qwen_processor(processor):
        images = processor.image_processor
        grid = images(images=[image], return_tensors="pt")["image_grid_thw"][0].tolist()
        t, h, w = (int(x) for x in grid)
        return ImageLayout(t * h * w // int(images.merge_size) ** 2, (t, h, w))
    data = processor._get_num_multimodal_tokens(image_sizes=[[image.height, image.width]])
    return ImageLayout(int(data.num_image_tokens[0]))


def image_item(
    processor: ChatTokenizer, spec: ModelSpec, media: bytes, system_prompt: str | None = None
) -> tuple[Image.Image, list[int], str]:
    """(decoded image, canonical context ids, entry id) of an image: what every engine caches
    it after and names it by (`mpic.addressing.entry_address` over fingerprint, context, media
    bytes). UnreadableMediaError (before any computation) when the bytes are not an image."""
    image = load_image(media)
    context_ids = canonical_context_ids(processor, system_prompt, spec.image_token_id)
    return image, context_ids, entry_address(spec.fingerprint, context_ids, media)


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
    caches for it (the reference runner's `mpic.engine.hf.entries`, vLLM's upload path in
    `mpic.engine.vllm`). InvalidRequestError for an empty document; PromptTooLongError when
    context + tokens exceed `max_len` (default: the model's maximum length)."""
    ids = document_token_ids(tokenizer, text)
    context_ids = document_context_ids(tokenizer, system_prompt)
    check_item_length("document", len(context_ids), len(ids), max_len or spec.max_model_len)
    return ids, context_ids, entry_address(spec.fingerprint, context_ids, document_bytes(text))


def check_item_length(kind: str, context_tokens: int, item_tokens: int, limit: int) -> None:
    """PromptTooLongError (param "file") when an item's canonical upload prompt (its context,
    then its tokens) exceeds `limit` tokens: what every engine checks before caching an item."""
    if context_tokens + item_tokens > limit:
        raise PromptTooLongError(
            f"the {kind} has {item_tokens} tokens; with its context that is over the model's "
            f"maximum of {limit}",
            param="file",
        )


def line_break_offsets(tokenizer: ChatTokenizer, token_ids: list[int]) -> list[int]:
    """Offsets of the tokens whose text holds a line break (the `boundary-k` policy recomputes
    them: delimiters gather attention, docs/fidelity.md)."""
    tokenizer = getattr(tokenizer, "tokenizer", tokenizer)
    pieces = tokenizer.batch_decode([[t] for t in token_ids])
    return [i for i, piece in enumerate(pieces) if "\n" in piece]
