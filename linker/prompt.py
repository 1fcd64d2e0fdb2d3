"""Rendering interleaved prompts with the model's own chat template (Serve replica, reference
runner, vLLM worker; duck-typed tokenizer, no transformers import).

A prompt is a list of parts: text strings and `ImageRef`s in any order (several images, the same
image twice). The chat template emits ONE placeholder id per image (`<image>` for LLaVA,
`<|vision_start|><|image_pad|><|vision_end|>` for Qwen2-VL, see docs/models.md); the plan builder
(`mpic.linker.plan`) expands each into the image's T tokens.

The canonical context an image's cache entry is computed in is the same template with the system
prompt and a user turn that starts with the image: its token ids before the placeholder are the
`context_token_ids` every entry records (the prefix policy compares prompts against them).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from mpic.errors import InvalidRequestError
from mpic.prompt_parts import ImageRef, PromptPart


class ChatTokenizer(Protocol):
    """The part of an HF tokenizer/processor the linker uses."""

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any: ...

    def __call__(self, text: str, **kwargs: Any) -> Any: ...


def _messages(system_prompt: str | None, parts: Sequence[PromptPart]) -> list[dict[str, Any]]:
    content: list[dict[str, Any]] = []
    for part in parts:
        if isinstance(part, ImageRef):
            content.append({"type": "image"})
        elif isinstance(part, str):
            content.append({"type": "text", "text": part})
        else:
            raise InvalidRequestError(f"prompt part of unknown type {type(part).__name__}")
    messages: list[dict[str, Any]] = []
    if system_prompt is not None:
        messages.append({"role": "system", "content": [{"type": "text", "text": system_prompt}]})
    messages.append({"role": "user", "content": content})
    return messages


def render_prompt_ids(
    tokenizer: ChatTokenizer,
    parts: Sequence[PromptPart],
    system_prompt: str | None,
    add_generation_prompt: bool = True,
) -> list[int]:
    """Token ids of the chat-templated prompt, one placeholder id per image part.

    `tokenizer` may be an HF processor: its text tokenizer is used (the processor's own call
    would expand image placeholders itself)."""
    tokenizer = getattr(tokenizer, "tokenizer", tokenizer)
    text = tokenizer.apply_chat_template(
        _messages(system_prompt, parts), tokenize=False, add_generation_prompt=add_generation_prompt
    )
    return list(tokenizer(text, add_special_tokens=True)["input_ids"])


def canonical_context_ids(
    tokenizer: ChatTokenizer, system_prompt: str | None, image_token_id: int
) -> list[int]:
    """Token ids of the canonical context BEFORE the image (system prompt + start of a user turn
    whose first part is the image). An entry's KV is computed after exactly these tokens."""
    ids = render_prompt_ids(
        tokenizer, [ImageRef("canonical")], system_prompt, add_generation_prompt=False
    )
    return ids[: ids.index(image_token_id)]


def image_refs(parts: Sequence[PromptPart]) -> list[str]:
    """The entry ids referenced by the prompt, in order of appearance (repeats kept)."""
    return [p.entry_id for p in parts if isinstance(p, ImageRef)]
