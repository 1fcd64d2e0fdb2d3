"""Rendering interleaved prompts with the model's own chat template (Serve replica, reference
runner, vLLM worker; duck-typed tokenizer, no transformers import).

A prompt is a list of parts: text strings, `ImageRef`s and `DocumentRef`s in any order (several
items, the same item twice). The chat template emits ONE placeholder id per image (`<image>` for
LLaVA, `<|vision_start|><|image_pad|><|vision_end|>` for Qwen2-VL, see docs/models.md); a document
becomes ONE `DOCUMENT_PLACEHOLDER` id: the template is rendered with a marker in its place and the
text on each side is tokenized on its own, so the document's own tokens (tokenized alone, as its
cache entry was) are never merged with its neighbours. The plan builder (`mpic.linker.plan`)
expands each placeholder into the item's T tokens.

Templates of text-only models (Llama, Qwen2 families) take a message's content as one string: the
text parts (and document markers) are concatenated; templates that handle typed content parts
(`{"type": "text"}`, `{"type": "image"}`) get them as a list.

The canonical context an item's cache entry is computed in is the same template with the system
prompt and a user turn that starts with the item: its token ids before the placeholder are the
`context_token_ids` every entry records (the prefix policy compares prompts against them).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from mpic.errors import InvalidRequestError
from mpic.prompt_parts import DocumentRef, ImageRef, PromptPart, Turn, item_refs

DOCUMENT_PLACEHOLDER = -1
"""The id a document occupies in rendered prompt ids (never given to a tokenizer or a model)."""

_DOCUMENT_MARK = "\ue000mpic-document\ue000"
"""Stands for a document in the rendered template text (a private-use character pair)."""


class ChatTokenizer(Protocol):
    """The part of an HF tokenizer/processor the linker uses."""

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any: ...

    def __call__(self, text: str, **kwargs: Any) -> Any: ...


def takes_typed_content(tokenizer: Any) -> bool:
    """True when the chat template renders typed content parts (a list of {"type": ...}); False
    for templates that concatenate a string content (text-only models)."""
    template = getattr(tokenizer, "chat_template", None) or ""
    if isinstance(template, dict):
        template = " ".join(template.values())
    return "'type'" in template or '"type"' in template or ".type" in template


def _messages(
    system_prompt: str | None, parts: Sequence[PromptPart], typed: bool = True
) -> list[dict[str, Any]]:
    turns: list[tuple[str, list[dict[str, Any]]]] = [("user", [])]
    for part in parts:
        content = turns[-1][1]
        if isinstance(part, Turn):
            if content or len(turns) > 1:
                turns.append((part.role, []))
            else:
                turns[0] = (part.role, [])
        elif isinstance(part, ImageRef):
            if not typed:
                raise InvalidRequestError("this model takes no images (a text-only model)")
            content.append({"type": "image"})
        elif isinstance(part, DocumentRef):
            content.append({"type": "text", "text": _DOCUMENT_MARK})
        elif isinstance(part, str):
            if _DOCUMENT_MARK in part:
                raise InvalidRequestError("prompt text contains a reserved character (U+E000)")
            content.append({"type": "text", "text": part})
        else:
            raise InvalidRequestError(f"prompt part of unknown type {type(part).__name__}")
    messages: list[dict[str, Any]] = []
    if system_prompt is not None:
        system = [{"type": "text", "text": system_prompt}]
        messages.append({"role": "system", "content": system if typed else system_prompt})
    for role, content in turns:
        if not typed:
            messages.append({"role": role, "content": "".join(c["text"] for c in content)})
        else:
            messages.append({"role": role, "content": content})
    return messages


def render_prompt_ids(
    tokenizer: ChatTokenizer,
    parts: Sequence[PromptPart],
    system_prompt: str | None,
    add_generation_prompt: bool = True,
) -> list[int]:
    """Token ids of the chat-templated prompt, one placeholder id per image part and one
    `DOCUMENT_PLACEHOLDER` per document part.

    `tokenizer` may be an HF processor: its text tokenizer is used (the processor's own call
    would expand image placeholders itself)."""
    tokenizer = getattr(tokenizer, "tokenizer", tokenizer)
    messages = _messages(system_prompt, parts, takes_typed_content(tokenizer))
    text = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    ids: list[int] = []
    for i, piece in enumerate(text.split(_DOCUMENT_MARK)):
        if i:
            ids.append(DOCUMENT_PLACEHOLDER)
        if piece:
            ids.extend(tokenizer(piece, add_special_tokens=i == 0)["input_ids"])
    return ids


def document_token_ids(tokenizer: ChatTokenizer, text: str) -> list[int]:
    """A document's own token ids: its text tokenized alone, no special tokens (what a
    `DOCUMENT_PLACEHOLDER` expands to). InvalidRequestError for an empty document."""
    tokenizer = getattr(tokenizer, "tokenizer", tokenizer)
    if _DOCUMENT_MARK in text:
        raise InvalidRequestError("the document contains a reserved character (U+E000)")
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    if not ids:
        raise InvalidRequestError("the document has no text")
    return ids


def canonical_context_ids(
    tokenizer: ChatTokenizer, system_prompt: str | None, image_token_id: int
) -> list[int]:
    """Token ids of the canonical context BEFORE the image (system prompt + start of a user turn
    whose first part is the image). An entry's KV is computed after exactly these tokens."""
    ids = render_prompt_ids(
        tokenizer, [ImageRef("canonical")], system_prompt, add_generation_prompt=False
    )
    return ids[: ids.index(image_token_id)]


def document_context_ids(tokenizer: ChatTokenizer, system_prompt: str | None) -> list[int]:
    """Token ids of a document's canonical context: the system prompt and the start of a user
    turn whose first part is the document (what precedes its `DOCUMENT_PLACEHOLDER`)."""
    ids = render_prompt_ids(
        tokenizer, [DocumentRef("canonical")], system_prompt, add_generation_prompt=False
    )
    return ids[: ids.index(DOCUMENT_PLACEHOLDER)]


def image_refs(parts: Sequence[PromptPart]) -> list[str]:
    """The entry ids referenced by the prompt (images and documents), in order of appearance
    (repeats kept)."""
    return item_refs(list(parts))
