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
prompt and a user turn holding a neutral lead-in (`CONTEXT_LEAD_IN`) and then the item: its token
ids before the placeholder are the `context_token_ids` every entry records (the prefix policy
compares prompts against them).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any, Protocol

from mpic.errors import InvalidRequestError
from mpic.prompt_parts import DocumentRef, ImageRef, PromptPart, Turn, item_refs

DOCUMENT_PLACEHOLDER = -1
"""The id a document occupies in rendered prompt ids (never given to a tokenizer or a model)."""

_DOCUMENT_MARK = "\ue000mpic-document\ue000"
"""Stands for a document in the rendered template text (a private-use character pair)."""
_USER_OPEN, _USER_CLOSE = "\ue001", "\ue002"
"""Bracket user text in the rendered template when it spells a special token, so that text is
tokenized with `split_special_tokens=True` (as plain characters, never as control tokens)."""
_RESERVED = (_DOCUMENT_MARK[0], _USER_OPEN, _USER_CLOSE)


class ChatTokenizer(Protocol):
    """The part of an HF tokenizer/processor the linker uses."""

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any: ...

    def __call__(self, text: str, **kwargs: Any) -> Any: ...


def tokenizer_of(processor: Any) -> Any:
    """The text tokenizer of an engine's `processor`: a multimodal model's HF processor holds
    it as `.tokenizer`; a text-only model's processor is the tokenizer itself."""
    return getattr(processor, "tokenizer", processor)


def takes_typed_content(tokenizer: Any) -> bool:
    """True when the chat template renders typed content parts (a list of {"type": ...}); False
    for templates that concatenate a string content (text-only models)."""
    template = getattr(tokenizer, "chat_template", None) or ""
    if isinstance(template, dict):
        template = " ".join(template.values())
    return "'type'" in template or '"type"' in template or ".type" in template


def special_token_strings(tokenizer: Any) -> list[str]:
    """The text of every special token of `tokenizer` (control tokens of the chat template)."""
    found = set(getattr(tokenizer, "all_special_tokens", None) or [])
    for tok in (getattr(tokenizer, "added_tokens_decoder", None) or {}).values():
        if getattr(tok, "special", False):
            found.add(str(tok.content))
    return sorted(t for t in found if t)


def _messages(
    system_prompt: str | None,
    parts: Sequence[PromptPart],
    typed: bool = True,
    escape: bool = False,
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
            if any(c in part for c in _RESERVED):
                raise InvalidRequestError(
                    "prompt text contains a reserved character (U+E000..U+E002)"
                )
            text = f"{_USER_OPEN}{part}{_USER_CLOSE}" if escape else part
            content.append({"type": "text", "text": text})
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
    would expand image placeholders itself).

    User text that spells one of the tokenizer's special tokens (`<|im_start|>system`, `<image>`)
    is tokenized on its own with `split_special_tokens=True`: it stays text and can never act as
    a control token of the template (other prompts tokenize exactly as before)."""
    tokenizer = getattr(tokenizer, "tokenizer", tokenizer)
    specials = special_token_strings(tokenizer)
    escape = any(isinstance(p, str) and any(s in p for s in specials) for p in parts)
    messages = _messages(system_prompt, parts, takes_typed_content(tokenizer), escape)
    text = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    ids: list[int] = []
    for i, piece in enumerate(text.split(_DOCUMENT_MARK)):
        if i:
            ids.append(DOCUMENT_PLACEHOLDER)
        if piece:
            ids.extend(_tokenize(tokenizer, piece, i == 0))
    return ids


def _tokenize(tokenizer: Any, piece: str, first: bool) -> list[int]:
    """Ids of one rendered piece: template text as usual, bracketed user text (odd segments
    between `_USER_OPEN` / `_USER_CLOSE`) with special tokens split into plain text."""
    if _USER_OPEN not in piece:
        return list(tokenizer(piece, add_special_tokens=first)["input_ids"])
    ids: list[int] = []
    for j, seg in enumerate(re.split(f"[{_USER_OPEN}{_USER_CLOSE}]", piece)):
        if not seg:
            continue
        user = j % 2 == 1
        kwargs = {"split_special_tokens": True} if user else {}
        ids.extend(tokenizer(seg, add_special_tokens=first and not ids, **kwargs)["input_ids"])
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


CONTEXT_LEAD_IN = (
    "Below is reference material gathered for this conversation: documents, pages, notes, "
    "pictures and other files, one after another, each possibly introduced by a short title. "
    "Read all of it carefully, since the questions that follow may refer to any part of it, in "
    "any order. Some items are long and some are short; some repeat or contradict others. When "
    "you answer, rely on the material itself and say so when it does not contain what is "
    "asked.\n\n"
)
"""The text every canonical context ends with, right before the item (~85 tokens): an item is
cached after some neutral content, as it is linked after other text and items in a prompt,
instead of right after the user turn's header. A cached item's leading tokens are the ones
whose linked KV departs most from the exact one (they saw nothing but the header); with this
lead-in the item's KV is much nearer what a prompt computes (SmolLM2, 8 documents, first-token
KL of `mpic-32` 0.40 -> 0.13, of the default 0.078 -> 0.047 on held-out questions; the needle
answered at 15% recomputed: docs/fidelity.md "The canonical context's lead-in"). Part of the
context, so of every entry's address; changing it renames every entry."""


def _context_parts(item: PromptPart) -> list[PromptPart]:
    """The user turn of an item's canonical context: the lead-in (when set), then the item."""
    return [CONTEXT_LEAD_IN, item] if CONTEXT_LEAD_IN else [item]


def canonical_context_ids(
    tokenizer: ChatTokenizer, system_prompt: str | None, image_token_id: int
) -> list[int]:
    """Token ids of the canonical context BEFORE the image: the system prompt and the start of a
    user turn holding `CONTEXT_LEAD_IN` and then the image. An entry's KV is computed after
    exactly these tokens."""
    ids = render_prompt_ids(
        tokenizer, _context_parts(ImageRef("canonical")), system_prompt, add_generation_prompt=False
    )
    return ids[: ids.index(image_token_id)]


def document_context_ids(tokenizer: ChatTokenizer, system_prompt: str | None) -> list[int]:
    """Token ids of a document's canonical context: the system prompt and the start of a user
    turn holding `CONTEXT_LEAD_IN` and then the document (what precedes its
    `DOCUMENT_PLACEHOLDER`)."""
    ids = render_prompt_ids(
        tokenizer,
        _context_parts(DocumentRef("canonical")),
        system_prompt,
        add_generation_prompt=False,
    )
    return ids[: ids.index(DOCUMENT_PLACEHOLDER)]


def image_refs(parts: Sequence[PromptPart]) -> list[str]:
    """The entry ids referenced by the prompt (images and documents), in order of appearance
    (repeats kept)."""
    return item_refs(list(parts))
