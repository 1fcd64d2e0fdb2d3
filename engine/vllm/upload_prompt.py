"""The canonical upload prompt of an item as a vLLM request (front end: the process that owns
the engine). An image's or a text document's prompt has the same canonical context, token ids,
span and content address as the reference runner's entry (`mpic.engine.items`), so both engines
name an item's entry alike; its request carries `mpic.engine.vllm.upload.upload_params`, by
which the connector's worker half (vLLM's worker process) captures the KV of the item's tokens
and stores it. `VllmFrontEnd.cache_image` / `cache_document` run it to its end.
"""

from __future__ import annotations

import uuid
from typing import Any

from mpic.engine.items import (
    check_item_length,
    document_item,
    image_item,
    image_layout,
    line_break_offsets,
)
from mpic.engine.vllm import upload as vllm_upload
from mpic.model_spec import ModelSpec

UploadForm = tuple[list[int], dict[str, Any] | None, tuple[int, int], str, dict[str, Any]]
"""(prompt token ids, multi-modal data or None, the item's span [start, end), entry id, extra)."""

__all__ = ["UploadForm", "document_upload_form", "image_upload_form", "upload_request"]


def image_upload_form(
    processor: Any,
    spec: ModelSpec,
    media: bytes,
    system_prompt: str | None,
    max_model_len: int | None,
) -> tuple[list[int], dict[str, Any], tuple[int, int], str, dict[str, Any]]:
    """(ids, multi-modal data, span, entry id, extra) of an image's canonical upload prompt:
    same canonical context, processor-exact image and content address as the reference runner
    (`mpic.engine.items.image_item`), so both engines name an image's entry alike; the
    span and grid are the image's own (`vision.image_layout`); PromptTooLongError over the
    engine's context limit (`max_model_len`, None: the model's)."""
    image, context, entry_id = image_item(processor, spec, media, system_prompt)
    layout = image_layout(processor, image)
    ids = context + [spec.image_token_id]
    if spec.vision_end_id is not None:
        ids.append(spec.vision_end_id)
    extra: dict[str, Any] = {"context_token_ids": list(context)}
    if layout.grid_thw is not None:
        extra["image_grid_thw"] = list(layout.grid_thw)
    limit = max_model_len or spec.max_model_len
    check_item_length("image", len(context), layout.num_tokens, limit)
    span = (len(context), len(context) + layout.num_tokens)
    return ids, {"image": image}, span, entry_id, extra


def document_upload_form(
    processor: Any,
    spec: ModelSpec,
    text: str,
    system_prompt: str | None,
    max_model_len: int | None,
) -> tuple[list[int], None, tuple[int, int], str, dict[str, Any]]:
    """(ids, None, span, entry id, extra) of a text document's canonical upload prompt
    (its canonical context, then its own token ids): the same token ids, content address and
    `extra` as the reference runner's entry (`mpic.engine.items.document_item`);
    InvalidRequestError when empty, PromptTooLongError over the engine's context limit
    (`max_model_len`, None: the model's)."""
    limit = max_model_len or spec.max_model_len
    doc, context, entry_id = document_item(processor, spec, text, system_prompt, max_len=limit)
    extra: dict[str, Any] = {
        "context_token_ids": list(context),
        "token_ids": list(doc),
        "line_breaks": line_break_offsets(processor, doc),
    }
    span = (len(context), len(context) + len(doc))
    return context + doc, None, span, entry_id, extra


def upload_request(
    fingerprint: str,
    prompt_token_ids: list[int],
    multi_modal_data: dict[str, Any] | None,
    span: tuple[int, int],
    entry_id: str,
    extra: dict[str, Any] | None = None,
) -> tuple[dict, Any]:
    """The vLLM request (prompt, SamplingParams) that stores the KV of its expanded prompt's
    tokens [span) as `entry_id` for the model `fingerprint` (`mpic.engine.vllm.upload`; a unique
    salt: the prefix cache never skips it). No multi-modal data: a text document's entry (media
    type "text")."""
    from vllm import SamplingParams

    media_type = "image" if multi_modal_data else "text"
    params = vllm_upload.upload_params(
        entry_id, fingerprint, *span, media_type=media_type, extra=extra
    )
    prompt: dict[str, Any] = {
        "prompt_token_ids": list(prompt_token_ids),
        "cache_salt": f"mpic-upload-{entry_id}-{uuid.uuid4().hex}",
    }
    if multi_modal_data:
        prompt["multi_modal_data"] = multi_modal_data
    sampling = SamplingParams(
        temperature=0.0, max_tokens=1, extra_args={"kv_transfer_params": params}
    )
    return prompt, sampling
