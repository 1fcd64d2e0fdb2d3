"""Engine-independent steps of serving (Encoder and LLM-worker replicas): identifying an
uploaded image, chat turns -> the linker's prompt parts, generated token ids -> streamed text,
and the linked-token count that `usage.prompt_tokens_details.cached_tokens` reports. Both
`ServeEngine`s use them.
"""

from __future__ import annotations

import hashlib
import io
from collections.abc import Callable, Iterable, Iterator

import torch

from mpic.deployments.messages import EncodedImage, LinkedPrompt, TokenEvent
from mpic.engine.hf.vision import load_image
from mpic.errors import InvalidRequestError
from mpic.linker.prompt import ImageRef, PromptPart
from mpic.types import LinkPlan

INLINE_PREFIX = "inline-"
"""Entry ids of inline images (computed for one request, never from the store)."""


def identify_image(media: bytes) -> tuple[str, str]:
    """(sha256 hex, MIME type) of an image; UnreadableMediaError (415) if it does not decode."""
    from PIL import Image

    load_image(media)
    with Image.open(io.BytesIO(media)) as img:
        return hashlib.sha256(media).hexdigest(), f"image/{(img.format or 'unknown').lower()}"


def prompt_parts(
    prompt: LinkedPrompt, system_prompt: str | None, inline_entry: Callable[[EncodedImage], str]
) -> tuple[str | None, list[PromptPart]]:
    """(system prompt, parts): the request's system message (default `system_prompt`) and the
    user turns as text strings and ImageRefs; `inline_entry(image)` makes an inline image
    linkable and returns its entry id. Entries cached after the deployment's system prompt link
    after any other (MPIC is position-independent). InvalidRequestError for an assistant turn."""
    parts: list[PromptPart] = []
    for turn in prompt.turns:
        if turn.role == "system":
            system_prompt = "".join(s.text for s in turn.segments)
            continue
        if turn.role == "assistant":
            raise InvalidRequestError(
                "assistant turns (multi-turn chats) are not supported", param="messages"
            )
        for seg in turn.segments:
            if seg.kind == "text":
                parts.append(seg.text)
            elif seg.kind == "inline":
                parts.append(ImageRef(inline_entry(seg.embeds)))
            else:
                parts.append(ImageRef(seg.entry_id))
    return system_prompt, parts


class Detokenizer:
    """Incremental detokenization: `push(tokens)` gives the text the new tokens add, holding
    back text that ends in an incomplete character (U+FFFD until its bytes are all decoded);
    `flush()` gives the rest. The pieces join to the decoded text of all tokens."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer, self.text, self.tokens = tokenizer, "", []

    def push(self, tokens: Iterable[int]) -> TokenEvent:
        """The TokenEvent of `tokens` (text may be empty while a character is incomplete)."""
        self.tokens.extend(tokens)
        full = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        if full.endswith("\ufffd"):
            return TokenEvent("")
        piece, self.text = full[len(self.text) :], full
        return TokenEvent(piece)

    def flush(self) -> TokenEvent:
        """The text held back so far."""
        full = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        piece, self.text = full[len(self.text) :], full
        return TokenEvent(piece)


def token_events(tokenizer, tokens: Iterable[int]) -> Iterator[TokenEvent]:
    """One TokenEvent per token as it arrives (`Detokenizer`), then any held-back text."""
    detok = Detokenizer(tokenizer)
    for token in tokens:
        yield detok.push([token])
    if (rest := detok.flush()).text:
        yield rest


def stored_linked_tokens(plan: LinkPlan) -> int:
    """Prompt tokens served from STORED entries at every layer (recompute depth 0; inline images
    excluded). Tokens a policy recomputes at some layers (VLCache's partial depths, CacheBlend's
    check layers) ran through the model and do not count."""
    stored = torch.tensor([not e.startswith(INLINE_PREFIX) for e in plan.entry_ids] + [False])
    return int(((plan.recompute_depth == 0) & stored[plan.source_entry]).sum())
